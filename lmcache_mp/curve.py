"""Authenticated, encrypted access from other machines: ZeroMQ CURVE.

The daemon has a key pair; each client that may connect has its own, and the daemon keeps
a directory of the allowed clients' public keys. Keys are ZeroMQ certificate files
(`lmcache-mp keygen` writes NAME.key, the public half to hand out, and NAME.key_secret, which
stays with its owner, mode 0600).

With CURVE configured, every client of the daemon authenticates, local ones too: the daemon
has one socket for all its endpoints. A client whose key is not in the directory never gets
a connection; ZeroMQ's authenticator (a ZAP handler thread in the daemon) refuses it, and the
client's HELLO times out with a message that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def generate_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (mode 0600) into `directory`; their paths."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (directory / f"{name}{suffix}").exists():
            raise FileExistsError(f"{directory / (name + suffix)} exists: choose another name or "
                                  "remove the old keys first")
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_key_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file; ValueError saying what is wrong."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key: pass the NAME.key_secret file")
    return public, secret


def load_public_key(path: str | Path) -> bytes:
    return _load(path)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the CURVE key file {path}: {err}") from None


@dataclass(frozen=True)
class ServerCurve:
    """The daemon's side: its key pair and the directory of allowed client public keys."""

    secret_key_file: Path
    allowed_keys_dir: Path

    def check(self) -> None:
        """Everything `secure` needs, checked before the daemon starts."""
        load_key_pair(self.secret_key_file)
        if not self.allowed_keys_dir.is_dir():
            raise ValueError(f"the allowed client keys directory {self.allowed_keys_dir} does not exist")
        if not any(self.allowed_keys_dir.glob("*.key")):
            raise ValueError(f"{self.allowed_keys_dir} holds no client public key (*.key): no client "
                             "could connect")

    def secure(self, context: zmq.Context, *socks: zmq.Socket) -> ThreadAuthenticator:
        """Make `socks` (not yet bound, of one context) CURVE servers that admit only the allowed
        keys; the returned authenticator (one per context) must be stopped after they are closed."""
        public, secret = load_key_pair(self.secret_key_file)
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.allowed_keys_dir))
        for sock in socks:
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        return auth


@dataclass(frozen=True)
class ClientCurve:
    """A client's side: the daemon's public key and the client's own key pair."""

    server_public_key_file: Path
    client_secret_key_file: Path

    def check(self) -> None:
        """Both key files can be read (ValueError saying which cannot)."""
        load_public_key(self.server_public_key_file)
        load_key_pair(self.client_secret_key_file)

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` (not yet connected) a CURVE client of the daemon."""
        public, secret = load_key_pair(self.client_secret_key_file)
        sock.curve_serverkey = load_public_key(self.server_public_key_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
