"""systemd's readiness protocol: tell the service manager when the daemon is ready.

With `Type=notify`, systemd holds units ordered after ours (vLLM's) until the daemon sends
`READY=1` on the datagram socket named by `$NOTIFY_SOCKET`; `STATUS=` lines show in
`systemctl status`, `STOPPING=1` marks a clean shutdown. Outside systemd the variable is unset
and every call is a no-op. The protocol is one datagram of `KEY=VALUE` lines, small enough
not to need libsystemd.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send `fields` (e.g. "READY=1", "STATUS=...") to systemd; False when not under systemd
    or the message could not be sent (logged once per failure: readiness is advisory)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract-namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError as err:
        logger.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], err)
        return False
    return True


def notify_when_ready(progress: Callable[[], tuple[bool, str]], stop: threading.Event,
                      interval_s: float = 0.5) -> threading.Thread | None:
    """Under systemd, a thread that shows `progress()`'s text as the unit's status until it
    reports ready, then sends READY=1. None outside systemd."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return None

    def watch() -> None:
        while True:
            ready, text = progress()
            if ready:
                notify("READY=1", f"STATUS={text}")
                return
            notify(f"STATUS={text}")
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=watch, name="sd-notify", daemon=True)
    thread.start()
    return thread
