"""The daemon process: start, sockets and threads, systemd readiness, logs.

    daemon.py     builds the engine, the servers and the metrics endpoint; runs until a signal
    server.py     the request loop on the daemon's sockets, and its worker threads
    sd_notify.py  systemd's READY / STOPPING / WATCHDOG messages
    logs.py       the log format (text or JSON)
"""
