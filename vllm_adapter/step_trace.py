"""A timeline of the connector's work, hook by hook, for finding where an engine step's time goes.

Off unless `lmcache.mp.step_trace` names a path prefix. Then each of the engine's processes appends
to `PREFIX.<role>.<pid>.jsonl` one JSON line per connector hook vLLM calls:
`{"hook", "step", "start", "ms", ...}`: the hook, the scheduler step whose metadata it works on
(absent where vLLM's call carries none), when it started (`time.monotonic()`, one clock for every
process of a machine), how long it took, and what the step asked of it (`loads`, `sync_loads`,
`stores`, `idle`) or what it answered (a lookup's `tokens`, None while still in flight).
`scripts/bench/step_trace_report.py` sums a trace up by kind of step.

Bounded: a process stops after MAX_LINES lines, saying so once. Off, a hook costs a microsecond.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any

from vllm_adapter.connector_common import LMCacheMPConnectorMetadata

logger = logging.getLogger(__name__)

MAX_LINES = 2_000_000  # ~200 MB: hours of a busy engine's steps


def describe(meta: LMCacheMPConnectorMetadata) -> dict[str, Any]:
    """What a step's metadata asks of the workers, as the trace records it."""
    return {"step": meta.step, "loads": len(meta.loads), "sync_loads": len(meta.sync_loads),
            "stores": len(meta.stores), "idle": meta.idle}


class StepTrace:
    """One process's trace file (none: every hook a no-op)."""

    def __init__(self, prefix: str | None, role: str):
        self.enabled = bool(prefix)
        self._file: IO[str] | None = None
        self._lines = 0
        if prefix:
            path = f"{prefix}.{role}.{os.getpid()}.jsonl"
            # Line-buffered: a killed engine's trace ends at its last whole line.
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed in close())
            logger.info("lmcache-mp: tracing the connector's hooks to %s", path)

    def hook(self, name: str, **fields: Any) -> AbstractContextManager[dict[str, Any]]:
        """Time the block as hook `name`; the record it yields takes more fields."""
        return self._timed(name, fields) if self._file is not None else nullcontext({})

    @contextmanager
    def _timed(self, name: str, fields: dict[str, Any]) -> Iterator[dict[str, Any]]:
        record: dict[str, Any] = {"hook": name, **fields}
        start = time.monotonic()
        try:
            yield record
        finally:
            record["start"] = start
            record["ms"] = (time.monotonic() - start) * 1e3
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        if self._lines >= MAX_LINES:
            logger.warning("lmcache-mp: the step trace reached %d lines: no more are written", MAX_LINES)
            self.close()
            return
        self._lines += 1
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
