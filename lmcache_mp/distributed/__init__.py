"""Storage-level keys and layouts (the seed's `lmcache.v1.distributed.api`)."""
