"""A request's own settings (`kv_transfer_params`, `vllm_adapter/request_params.py`) through both
halves of the connector and the real daemon: the switches that skip a request's load or its stores,
and the limits on how much of it is loaded or stored. Bad values are ignored, with a warning."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lmcache_mp.settings import markdown_table
from lmcache_mp.testing.blocks import BLOCK, CHUNK, block_hashes
from lmcache_mp.testing.launcher import DaemonProcess
from tests.support.connector_helpers import Blocks, Worker, match, request, step, store_prompt
from tests.support.helpers import status
from vllm_adapter.connector_common import ConnectorSettings
from vllm_adapter.connector_scheduler import SchedulerSide
from vllm_adapter.request_params import RequestParams

DAEMON_ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
ROOT = Path(__file__).resolve().parents[2]
TOKENS = [random.Random(13).randrange(1000) for _ in range(3 * CHUNK + 3)]  # 3 chunks and 3 tokens
TABLE = list(range(1, 9))  # 7 blocks hold them


@pytest.fixture
def halves(daemon: DaemonProcess) -> Iterator[tuple[SchedulerSide, Worker]]:
    settings = ConnectorSettings(url=daemon.url, reconnect_interval_s=0.3, load_mode="async", tails=False)
    scheduler = SchedulerSide(settings, "m", 1, 0, BLOCK)
    worker = Worker(settings, seed=1)
    yield scheduler, worker
    worker.side.shutdown()
    scheduler.shutdown()


def with_params(request_id: str, params: dict[str, object], tokens: list[int] = TOKENS) -> object:
    req = request(request_id, tokens)
    req.kv_transfer_params = params
    return req


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_switches_skip_a_requests_load_or_its_stores(
        halves: tuple[SchedulerSide, Worker], daemon: DaemonProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    """{"lmcache.mp.skip_load": true} / {"lmcache.mp.skip_save": true}: that request alone neither
    looks up nor loads / stores nothing; a value other than true or false is ignored."""
    scheduler, worker = halves
    no_save = with_params("no-save", {"lmcache.mp.skip_save": True})
    assert match(scheduler, no_save) == (0, False)
    meta = scheduler.build_connector_meta(step({"no-save": TABLE},
                                                new=((no_save, 0, no_save.num_prompt_tokens),)))
    assert meta.stores == {}
    assert scheduler.request_finished(no_save) is False

    store_prompt(scheduler, worker, with_params("bad", {"lmcache.mp.skip_save": "yes"}), {"bad": TABLE})
    assert "kv_transfer_params lmcache.mp.skip_save='yes' is not true or false; ignored" in caplog.text
    assert status(daemon.url).objects == 3  # stored as any request

    lookups_before = status(daemon.url).lookup_chunks_total
    assert match(scheduler, with_params("no-load", {"lmcache.mp.skip_load": True})) == (0, False)
    assert status(daemon.url).lookup_chunks_total == lookups_before
    assert match(scheduler, request("plain", TOKENS)) == (3 * CHUNK, True)


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_max_load_tokens_caps_the_load_at_whole_chunks(
        halves: tuple[SchedulerSide, Worker], daemon: DaemonProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    """The daemon holds 3 chunks of the prompt. A load covers at most `max_load_tokens` past vLLM's
    own hit, cut to whole chunks; vLLM's native name is read too, ours wins; bad values are ignored."""
    scheduler, worker = halves
    store_prompt(scheduler, worker, request("first", TOKENS), {"first": TABLE})
    assert match(scheduler, request("plain", TOKENS)) == (3 * CHUNK, True)
    cases = {
        "ours": ({"lmcache.mp.max_load_tokens": 2 * CHUNK + 5}, 0, 2 * CHUNK),
        "native": ({"max_load_tokens": CHUNK}, 0, CHUNK),
        "both": ({"lmcache.mp.max_load_tokens": CHUNK, "max_load_tokens": 0}, 0, CHUNK),
        "zero": ({"lmcache.mp.max_load_tokens": 0}, 0, 0),
        "past-local": ({"lmcache.mp.max_load_tokens": CHUNK + BLOCK}, CHUNK, CHUNK),  # to 2 chunks
        "short-of-a-chunk": ({"lmcache.mp.max_load_tokens": CHUNK - 1}, 0, 0),
        "rest-of-a-chunk": ({"lmcache.mp.max_load_tokens": CHUNK - 1}, BLOCK, CHUNK - BLOCK),
        "more-than-held": ({"lmcache.mp.max_load_tokens": 10 * CHUNK}, 0, 3 * CHUNK),
    }
    for name, (params, local, loaded) in cases.items():
        assert match(scheduler, with_params(name, params), local) == (loaded, loaded > 0), name
    for value in (-1, 1.5, True, "64"):
        assert match(scheduler, with_params(f"bad-{value}", {"lmcache.mp.max_load_tokens": value})) == \
            (3 * CHUNK, True)
        assert f"lmcache.mp.max_load_tokens={value!r} is not an integer >= 0; ignored" in caplog.text

    capped = with_params("capped", {"lmcache.mp.max_load_tokens": 2 * CHUNK})
    assert match(scheduler, capped) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(capped, Blocks(TABLE), 2 * CHUNK)
    meta = scheduler.build_connector_meta(step({"capped": TABLE}))
    blocks = 2 * CHUNK // BLOCK
    assert meta.loads["capped"].block_ids == TABLE[:blocks]
    assert meta.loads["capped"].block_hashes == block_hashes(TOKENS)[:blocks]
    worker.run(meta)
    worker.wait_reported("received", "capped")
    assert not worker.reported["failed"]


@pytest.mark.daemon_args(*DAEMON_ARGS)
def test_max_offload_tokens_caps_the_stores(halves: tuple[SchedulerSide, Worker],
                                            daemon: DaemonProcess) -> None:
    """Stores cover at most the request's first `max_offload_tokens` tokens, in whole chunks. Each
    case has a prompt of its own, so the daemon's objects add up case by case."""
    scheduler, worker = halves
    stored = 0
    cases = (("ours", {"lmcache.mp.max_offload_tokens": 2 * CHUNK + 7}, 2),
             ("native", {"max_offload_tokens": CHUNK}, 1),
             ("zero", {"lmcache.mp.max_offload_tokens": 0}, 0))
    for seed, (name, params, chunks) in enumerate(cases):
        tokens = [random.Random(100 + seed).randrange(1000) for _ in range(len(TOKENS))]
        req = with_params(name, params, tokens)
        assert match(scheduler, req) == (0, False)
        meta = scheduler.build_connector_meta(step({name: TABLE}, new=((req, 0, req.num_prompt_tokens),)))
        if not chunks:
            assert meta.stores == {} and scheduler.request_finished(req) is False
            continue
        assert meta.stores[name].block_hashes == block_hashes(tokens)[:chunks * CHUNK // BLOCK], name
        worker.run(meta)
        assert scheduler.request_finished(req) is True
        worker.collect({name})
        worker.wait_reported("sent", name)
        stored += chunks
        assert status(daemon.url).objects == stored, name


def test_docs_vllm_page_lists_every_request_key() -> None:
    page = (ROOT / "docs" / "vllm.md").read_text()
    assert markdown_table(RequestParams, "lmcache.mp.") in page, \
        "regenerate docs/vllm.md's per-request table: markdown_table(RequestParams, 'lmcache.mp.')"
