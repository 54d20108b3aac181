"""The daemon's semantics: what LOOKUP, STORE, RETRIEVE and the rest mean, between the sockets and
storage.

    engine.py            the handlers of LOOKUP, STORE, RETRIEVE, END_SESSION, CLEAR, RESET_MODEL...
    dispatch.py          which requests run where (the I/O loop, the worker threads, the load lane)
    registry.py          registered KV caches: who may read and write which memory
    keys.py, hashing.py  chunk keys, from a worker's block hashes or from token ids
    sessions.py          a request's leases, until END_SESSION or their TTL
    cancellation.py      stores and loads the client gave up on
    tails.py             the partial last chunks (tails) and their index
    capacity_advisor.py  what more (or less) pool memory would have served
    status.py            the STATUS report

Nothing is imported here: `daemon/server.py` imports `status` and `dispatch` before torch loads.
"""
