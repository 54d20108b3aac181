#!/usr/bin/env python
"""Draw the README's headline chart (docs/img/headlines.png) from figures already measured.

    .venv/bin/python scripts/bench/plot_headlines.py [--out docs/img/headlines.png]

Nothing is measured here: every number below is copied from the benchmark page named beside it
(docs/benchmarks/), where its method, machine and date are. Change a page's current results, then
change its numbers here and run this again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import figure

# docs/benchmarks/serving.md: returning turns' mean TTFT, 8 users x 3 rounds, vLLM's cache 15.8% of
# the working set; the floor is vLLM's own cache holding the whole working set.
SERVING_TTFT_MS = {"vLLM\nalone": 542, "vLLM +\nlmcache-mp": 66, "vLLM's cache\nholding all": 70}
# docs/benchmarks/data-plane.md: GB/s, 256 MiB requests, against one core's best torch copy (the
# gather baseline measured 17.5-17.7: its middle).
DATA_PLANE_GBPS = {"STORE": (16.7, 17.6), "RETRIEVE": (16.5, 16.8)}
# docs/benchmarks/warm-restart.md: seconds from `lmcache-mp serve` on a pool file a SIGTERMed daemon
# left, per pool size.
WARM_RESTART_S = {"1 GiB": (1.02, 1.06, 1.10), "4 GiB": (1.04, 1.08, 1.41), "16 GiB": (1.05, 1.14, 2.39)}
WARM_RESTART_STAGES = ("serving", "first adopted hit", "all verified")


def draw(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    title = "lmcache-mp, measured on a 2-vCPU VM (docs/benchmarks.md)"
    with figure(out, 1, 3, figsize=(13, 4), title=title, dpi=100) as (serving, copies, restart):
        bars = serving.bar(list(SERVING_TTFT_MS), list(SERVING_TTFT_MS.values()),
                           color=["#999999", "#1f77b4", "#2ca02c"])
        serving.bar_label(bars, fmt="%d ms")
        serving.set_title("Multi-turn chat: returning turns' TTFT")
        serving.set_ylabel("mean TTFT (ms)")

        names = list(DATA_PLANE_GBPS)
        xs = range(len(names))
        daemon = copies.bar([x - 0.2 for x in xs], [DATA_PLANE_GBPS[n][0] for n in names], 0.4,
                            label="through the daemon", color="#1f77b4")
        floor = copies.bar([x + 0.2 for x in xs], [DATA_PLANE_GBPS[n][1] for n in names], 0.4,
                           label="one core's best torch copy", color="#999999")
        copies.bar_label(daemon, fmt="%.1f")
        copies.bar_label(floor, fmt="%.1f")
        copies.set_xticks(list(xs), names)
        copies.set_title("KV copies, 256 MiB requests (CPU)")
        copies.set_ylabel("GB/s")
        copies.legend(loc="lower center")

        sizes = list(WARM_RESTART_S)
        for i, (stage, color) in enumerate(zip(WARM_RESTART_STAGES, ["#aec7e8", "#1f77b4", "#2ca02c"],
                                               strict=True)):
            restart.bar([x + (i - 1) * 0.27 for x in range(len(sizes))],
                        [WARM_RESTART_S[s][i] for s in sizes], 0.27, label=stage, color=color)
        restart.set_xticks(range(len(sizes)), [f"{s} pool" for s in sizes])
        restart.set_title("Warm restart: seconds after the start")
        restart.set_ylabel("s")
        restart.legend(loc="upper left")

    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/headlines.png"))
    draw(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
