"""KV events for routers: which chunks the daemon holds.

    log.py        the event vocabulary (also the connector's) and the bounded log the engine appends to
    publisher.py  serves the log to subscribers, replayed from a sequence number
    resync.py     announces what the pool and the tiers hold, in slices, after a start or a clear
"""
