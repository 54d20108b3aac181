"""The soak's hostile traffic (`scripts/soak/soak.py`): malformed requests from a raw socket, a
worker flooding CANCEL_TRANSFERS, and idle connections held while a worker must still register."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import socket
import time
from collections import Counter
from typing import Any

import msgspec
import zmq
from soak_client import BLOCKS_PER_CHUNK, DTYPE, LAYOUT, reason_class

from lmcache_mp.custom_types import IPCCacheEngineKey, get_customized_encoder
from lmcache_mp.engine.cancellation import DEFAULT_MAX_CANCELLED_PER_INSTANCE
from lmcache_mp.errors import LMCacheMPError, ServerError
from lmcache_mp.mq.client import MessageQueueClient
from lmcache_mp.mq.frames import MAX_FRAME_BYTES, REQUEST_ID
from lmcache_mp.protocol import CANCEL_PAYLOAD, ErrorCode, KVCacheRegistration, RequestType, StatusReport
from lmcache_mp.testing.blocks import BLOCK, LAYERS, NUM_BLOCKS, SHAPE
from lmcache_mp.testing.kv_worker import make_caches
from lmcache_mp.testing.launcher import daemon_status
from vllm_adapter import LMCacheMPWorkerAdapter
from vllm_adapter.kv_export import export_kv_caches

# ---- malformed traffic ------------------------------------------------------------------------


class GarbageSender:
    """Malformed and hostile requests from a raw DEALER, none of which may change what a client
    reads back: bad block ids and other models' keys only, never a valid RETRIEVE into a
    client's caches."""

    def __init__(self, url: str, rng: random.Random):
        self.url = url
        self.rng = rng
        self.encode = get_customized_encoder().encode
        self.next_id = 1 << 40
        self.sent = 0
        self.replies: Counter = Counter()  # by status name
        self.unreplied_kinds: Counter = Counter()
        self.oversized = 0  # messages over the daemon's size limit: dropped with their connection
        self.handles, _ = export_kv_caches(make_caches([4, *SHAPE[1:]], DTYPE, LAYERS, seed=None))

    def _key(self) -> IPCCacheEngineKey:
        return IPCCacheEngineKey("garbage-model", 1, 0, chunk_hash=self.rng.randbytes(32),
                                 request_id=f"garbage-{self.rng.randrange(1000)}")

    def _request(self, request_type: int, *payload: Any) -> list[bytes]:
        self.next_id += 1
        return [REQUEST_ID.pack(self.next_id), self.encode(request_type), self.encode(list(payload))]

    def messages(self, instances: list[int]) -> dict[str, list[bytes]]:
        """One message of each kind, by what is wrong with it."""
        r = self.rng
        real = r.choice(instances) if instances else r.getrandbits(63)
        nobody = r.getrandbits(63)  # an instance id that is not registered
        keys = [self._key() for _ in range(r.randint(1, 4))]
        n = len(keys) * BLOCKS_PER_CHUNK  # block ids that go with the keys
        store, retrieve = int(RequestType.STORE), int(RequestType.RETRIEVE)
        return {
            "noise": [r.randbytes(r.randrange(64)) for _ in range(r.randint(1, 4))],
            "an id alone": [r.randbytes(8)],
            "unknown type": self._request(999),
            "undecodable type": [REQUEST_ID.pack(r.getrandbits(64)), r.randbytes(5)],
            "no payload": self._request(int(RequestType.LOOKUP)),
            "garbage payload": [*self._request(store), r.randbytes(40), b"x", b"y", b"z"],
            "garbage registration": self._request(int(RequestType.REGISTER_KV_CACHE), r.getrandbits(63),
                                                  [r.randbytes(9)], "no"),
            "STORE, unknown instance": self._request(store, keys, nobody, list(range(n)), b""),
            "RETRIEVE, unknown instance": self._request(retrieve, keys, nobody, list(range(n)), b""),
            "STORE, block ids out of range": self._request(store, keys, real,
                                                           [NUM_BLOCKS + r.randrange(10**6)] * n, b""),
            "RETRIEVE, negative block ids": self._request(retrieve, keys, real, [-(2**40)] * n, b""),
            "RETRIEVE, too few block ids": self._request(retrieve, keys, real, list(range(n - 1)), b""),
            "STORE, bogus event handle": self._request(store, keys, real, [0] * n, b"not an event handle"),
            "LOOKUP, another model": self._request(int(RequestType.LOOKUP), keys),
            "END_SESSION, unknown": self._request(int(RequestType.END_SESSION), f"garbage-{nobody}"),
            "UNREGISTER, unknown": self._request(int(RequestType.UNREGISTER_KV_CACHE), nobody),
            "PING": self._request(int(RequestType.PING), r.getrandbits(63)),
            # Well-formed caches whose attach channel never opens: the daemon waits for it.
            "REGISTER, attach channel never opened": self._request(
                int(RequestType.REGISTER_KV_CACHE), r.getrandbits(63), self.handles,
                KVCacheRegistration("garbage-model", 1, 0, LAYOUT, r.randbytes(16))),
        }

    def _socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        return sock

    def oversize(self) -> None:
        """One message over the daemon's size limit; libzmq drops it with the connection, so
        it gets no reply: its own socket, and nothing waited for."""
        sock = self._socket()
        try:
            sock.send_multipart([*self._request(int(RequestType.LOOKUP)), bytes(MAX_FRAME_BYTES + 1)])
            self.oversized += 1
            sock.poll(100)
        finally:
            sock.close(linger=0)

    def burst(self, instances: list[int], timeout_s: float) -> None:
        """Send one round of every kind, then wait for one reply per message."""
        self.oversize()
        sock = self._socket()
        try:
            batch = self.messages(instances)
            waiting = {}  # first frame (echoed in the reply) -> kind
            for kind, frames in batch.items():
                sock.send_multipart(frames)
                waiting[frames[0]] = kind
            self.sent += len(batch)
            deadline = time.monotonic() + timeout_s
            while waiting and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                reply = sock.recv_multipart()
                waiting.pop(reply[0], None)
                status = msgspec.msgpack.decode(reply[1]) if len(reply) == 3 else -1
                self.replies[ErrorCode(status).name if status in ErrorCode._value2member_map_
                             else f"malformed reply {len(reply)} frames"] += 1
            self.unreplied_kinds.update(waiting.values())
        finally:
            sock.close(linger=0)


# ---- hostile workers: cheap attacks, each repeated on a schedule of its own -------------------

# Ids of 47 characters (see `CancelFlooder.flood`): ~196 KiB of msgpack per CANCEL_TRANSFERS,
# within the daemon's cap on one request's payload (a bigger one is refused BAD_PAYLOAD unread).
FLOOD_IDS_PER_REQUEST = 4096
assert FLOOD_IDS_PER_REQUEST * 50 < CANCEL_PAYLOAD
# Past what the daemon keeps per instance: the last request finds the instance's record full.
FLOOD_REQUESTS = DEFAULT_MAX_CANCELLED_PER_INSTANCE // FLOOD_IDS_PER_REQUEST + 1
FLOOD_VICTIMS = 2  # clients' instances named by every other flood
IDLE_HOLD_S = 3.0  # at most; half a chaos interval in shorter runs


def registered_worker(url: str, model: str, timeout_s: float) -> LMCacheMPWorkerAdapter:
    """A worker adapter with a small CPU cache registered; raises what made that fail."""
    worker = LMCacheMPWorkerAdapter(url, None, model, 1, 0, BLOCK, timeout_s=timeout_s,
                                    connect_timeout_s=timeout_s)
    try:
        worker.register_kv_caches(make_caches([4, *SHAPE[1:]], DTYPE, LAYERS, seed=None), LAYOUT)
    except BaseException:
        worker.shutdown()
        raise
    return worker


class CancelFlooder:
    """A registered worker floods CANCEL_TRANSFERS. For its own instance the
    daemon keeps what it is told (a confirmed cancel is a promise it never forgets early), so
    the record is bounded per instance: past the bound, OVERLOADED, and the clients' cancels
    still find room. For another connection's instance, FORBIDDEN: anything else would let any
    client cancel a worker's transfers (its flood once evicted a worker's confirmed cancel)."""

    def __init__(self, url: str, seed: int, timeout_s: float):
        self.url = url
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.floods = 0
        self.answers: Counter = Counter()  # "own instance: OVERLOADED", "a client's instance: FORBIDDEN"...
        self.unanswered = 0
        self.failures: list[str] = []  # an answer no correct daemon gives

    def flood(self, clients: list[int]) -> None:
        try:
            worker = registered_worker(self.url, "soak-cancel-flood", self.timeout_s)
        except (LMCacheMPError, OSError) as err:
            self.answers[f"not registered ({reason_class(str(err))})"] += 1
            return
        try:
            self.floods += 1
            for n in range(FLOOD_REQUESTS):
                ids = [f"flood-{self.floods:06d}-{n}-{i:032x}" for i in range(FLOOD_IDS_PER_REQUEST)]
                self._count("own instance", worker.instance_id, self._cancel(worker, worker.instance_id, ids),
                            ("answered", "OVERLOADED"))
            if self.floods % 2 == 0:  # ids shaped like the clients' own request ids
                for victim in self.rng.sample(clients, min(FLOOD_VICTIMS, len(clients))):
                    ids = [f"soak-{self.rng.randrange(8)}-{self.rng.randrange(1, 10**5)}" for _ in range(256)]
                    answer = self._cancel(worker, victim, ids)
                    self._count("a client's instance", victim, answer, ("FORBIDDEN",))
        finally:
            worker.shutdown()

    def _cancel(self, worker: LMCacheMPWorkerAdapter, instance_id: int, ids: list[str]) -> str:
        try:
            worker.mq_client.submit(RequestType.CANCEL_TRANSFERS, [instance_id, ids],
                                    timeout_s=self.timeout_s).result(self.timeout_s)
        except ServerError as err:
            return err.code.name
        except LMCacheMPError:
            return "no reply"
        return "answered"

    def _count(self, whose: str, instance_id: int, answer: str, expected: tuple[str, ...]) -> None:
        if answer not in expected and answer != "no reply" and whose != "own instance":
            report = try_status(self.url)
            if report is not None and instance_id not in report.registered_instances:
                answer += ", the instance gone meanwhile"  # its client was killed: nothing to forbid
                expected = (answer,)
        self.answers[f"{whose}: {answer}"] += 1
        if answer == "no reply":
            self.unanswered += 1
        elif answer not in expected and len(self.failures) < 10:
            self.failures.append(f"CANCEL_TRANSFERS for {whose} {instance_id}: {answer}")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed (a peek that finds the end of the stream)."""
    sock.setblocking(False)  # a socket with a timeout would wait that long for something to read
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class IdleConnections:
    """Connections that never say anything: `count` ZeroMQ DEALERs on the daemon's socket and as
    many raw Unix connections to its attach socket (HELLO's attach_socket, where a worker hands
    its memfds over), held a while, then closed. Stalled clients must neither hold the daemon's
    memory or descriptors once gone (the final checks) nor block anyone while there: meanwhile a
    worker registers through that same attach socket and STATUS is answered. The daemon may
    close an idle attach connection first (a deadline of its own): counted, not a failure."""

    def __init__(self, url: str, count: int, timeout_s: float):
        self.url = url
        self.count = count
        self.timeout_s = timeout_s
        self.rounds = 0
        self.opened: Counter = Counter()  # "ZeroMQ", "attach", "attach refused at connect"
        self.closed_by_daemon = 0  # attach connections the daemon had closed when we closed them
        self.served: Counter = Counter()  # "registration", "STATUS"; "... failed"
        self.registration_s: list[float] = []  # how long a registration took while they were held
        self.failures: list[str] = []
        self.probe: RegistrationProbe | None = None  # the next round's, once `prepare` started it
        self.probe_late = 0  # rounds put off: their probe's process was still starting

    def prepare(self) -> None:
        """Start the next round's registration probe and wait until its imports are done (up to a
        minute on a busy machine): the soak calls this before it takes the lock that its restarts
        wait for, so that no restart waits for a Python process to start."""
        if self.probe is None:
            self.probe = RegistrationProbe(self.url, self.timeout_s)
        self.probe.ready.wait(PROBE_START_S)

    def hold(self, hold_s: float) -> None:
        """Open them, check that the daemon serves meanwhile, close them after `hold_s`."""
        probe: RegistrationProbe | None = self.probe or RegistrationProbe(self.url, self.timeout_s)
        self.probe = None
        try:
            hello_client = MessageQueueClient(self.url)
            try:
                attach_socket = hello_client.handshake("soak idle connections", self.timeout_s).attach_socket
            except LMCacheMPError:
                return  # daemon away (not during a restart: the soak holds them off); nothing to attack
            finally:
                hello_client.close()
            if not probe.ready.wait(PROBE_START_S):
                # Still importing on a starved machine: not the daemon's doing. The next round
                # takes it; a run whose probe never starts ends with no round (a failed check).
                self.probe, probe = probe, None
                self.probe_late += 1
                return
            started = time.monotonic()
            dealers, raws = self._open(attach_socket)
            self.rounds += 1
            try:
                probe.go.set()
                self.served["STATUS" if try_status(self.url) is not None else "STATUS failed"] += 1
                time.sleep(max(0.0, started + hold_s - time.monotonic()))
                self.closed_by_daemon += sum(closed_by_peer(raw) for raw in raws)
            finally:
                for dealer in dealers:
                    dealer.close(linger=0)
                for raw in raws:
                    raw.close()
            # HELLO, attach, REGISTER, UNREGISTER: each bounded
            self._count(probe.outcome(4 * self.timeout_s + 5))
        finally:
            if probe is not None:
                probe.close()

    def _open(self, attach_socket: str) -> tuple[list[zmq.Socket], list[socket.socket]]:
        dealers, raws = [], []
        for _ in range(self.count):
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.url)
            dealers.append(dealer)
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(1.0)
            try:
                raw.connect(attach_socket)
            except OSError:  # a daemon that bounds pending attach connections may refuse more
                raw.close()
                self.opened["attach refused at connect"] += 1
                continue
            raws.append(raw)
        self.opened["ZeroMQ"] += len(dealers)
        self.opened["attach"] += len(raws)
        return dealers, raws

    def _count(self, outcome: tuple[str, float] | None) -> None:
        if outcome is None:
            self.served["registration failed"] += 1
            self.failures.append("a registration made while idle connections were held never finished")
            return
        error, took_s = outcome
        if error:
            self.served["registration failed"] += 1
            if len(self.failures) < 10:
                self.failures.append(f"a registration made while idle connections were held failed: {error}")
            return
        self.served["registration"] += 1
        self.registration_s.append(took_s)


PROBE_START_S = 60.0  # a spawned Python importing torch, on a busy machine


class RegistrationProbe:
    """A worker in a process of its own that registers when told (`go`): the daemon's attach
    shares are per process, as a real worker is, so the process holding the idle connections could
    not prove that another one still registers. Started, and its imports done (`ready`), before
    the connections open."""

    def __init__(self, url: str, timeout_s: float):
        ctx = mp.get_context("spawn")
        self.ready, self.go = ctx.Event(), ctx.Event()
        self.answers = ctx.SimpleQueue()
        self.proc = ctx.Process(target=_probe_main, args=(url, timeout_s, self.ready, self.go, self.answers),
                                name="soak-idle-probe", daemon=True)
        self.proc.start()

    def outcome(self, timeout_s: float) -> tuple[str, float] | None:
        """("" or why it failed, seconds the registration took); None if it never finished."""
        self.proc.join(timeout_s)
        return None if self.proc.is_alive() or self.answers.empty() else self.answers.get()

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def _probe_main(url: str, timeout_s: float, ready: Any, go: Any, answers: Any) -> None:
    ready.set()
    if not go.wait(PROBE_START_S):
        return
    started = time.monotonic()
    try:
        registered_worker(url, "soak-idle-probe", timeout_s).shutdown()
    except (LMCacheMPError, OSError) as err:
        answers.put((str(err) or type(err).__name__, time.monotonic() - started))
        return
    answers.put(("", time.monotonic() - started))



def try_status(url: str) -> StatusReport | None:
    with contextlib.suppress(LMCacheMPError):
        return daemon_status(url, timeout_s=2.0)
    return None
