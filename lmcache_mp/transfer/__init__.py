"""Moving KV between registered caches and the daemon's pool: layouts, copies, sharing."""
