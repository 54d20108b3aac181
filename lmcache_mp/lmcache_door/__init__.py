"""The lmcache door: a second front door on the daemon's engine that serves LMCache's own vLLM
connector (`LMCacheMPConnector` with the `lmcache` package installed), so that a deployment of
`lmcache server` switches to this daemon by changing the daemon alone.

- `wire.py`: LMCache's multiprocess request wire (lmcache 0.5.6), our own structs and op table.
- `segments.py`: the caches LMCache's connector registers on CPU, named POSIX shared-memory
  segments, opened under checks and copied without mapping them.
- `door.py`: the ROUTER bound at each `lmcache_listen` URL, and each request's meaning in terms of
  the engine's LOOKUP, STORE, RETRIEVE and sessions; `keys.py`, LMCache's keys in the engine's terms;
  `liveness.py`, its registrations and when their workers are gone.
- `engine_driven.py`, `staging.py`: LMCache's `engine_driven` mode, its worker writing chunks into a
  staging segment of its registration's own (never serialized Python objects, never the pool).
- `events.py`: LMCache's KV event stream, served from the engine's event log.

Importing the package loads no torch: the door answers PING and GET_CHUNK_SIZE while the engine is
still being built.
"""
