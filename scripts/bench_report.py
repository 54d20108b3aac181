"""What every benchmark ends with: a MET/MISS line per target, its figures as JSON, its plot as PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def finish(out: Path, stem: str, checks: dict[str, bool], figures: dict, draw: Callable[[Path], None],
           note: str = "") -> None:
    """Print the verdicts, write OUT/STEM.json (`figures`) and OUT/STEM.png (`draw(path)`)."""
    print()
    for name, ok in checks.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    (out / f"{stem}.json").write_text(json.dumps(figures, indent=2))
    draw(out / f"{stem}.png")
    print(f"\nwrote {out / f'{stem}.png'} and {out / f'{stem}.json'}{note}")
