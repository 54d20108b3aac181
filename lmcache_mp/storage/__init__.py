"""The daemon's storage: the CPU memory pool that holds stored KV chunks."""
