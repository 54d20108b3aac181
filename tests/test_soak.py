"""Issue 10: the chaos soak (`scripts/soak.py`) for 45 s: clients SIGKILLed, the daemon restarted
(SIGTERM or SIGKILL) with its disk tier, malformed traffic; every byte retrieved is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


def test_soak_45_s_of_chaos_serves_no_wrong_byte_and_leaks_nothing(tmp_path: Path) -> None:
    figures_path = tmp_path / "figures.json"
    # Chaos every 4 s: the daemon restarts twice in the first 70% of the run, clients are killed
    # throughout; the last 30% is one daemon's, whose idle resources end the run.
    out = subprocess.run([sys.executable, str(SOAK), "--duration-s", "45", "--chaos-interval-s", "4",
                          "--last-daemon-frac", "0.3", "--seed", "1", "--out", str(tmp_path),
                          "--json", str(figures_path)],
                         capture_output=True, text=True, timeout=110)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    f = json.loads(figures_path.read_text())

    assert f["ops"]["STORE ok"] > 100 and f["ops"]["chunks verified"] > 1000, report
    assert f["wrong_bytes"] == 0 and f["wrong_chunks"] == 0, report
    assert f["unreplied"] == 0 and f["timeouts_while_daemon_up"] == 0, report
    assert f["garbage"]["sent"] > 0 and f["garbage"]["unreplied"] == 0, report
    assert f["clients_killed"] >= 2 and f["clients_hung"] == 0 and f["clients_crashed"] == 0, report
    restarts = f["restarts"]
    assert len(restarts) >= 2, report
    assert all(r["recovery_s"] is not None for r in restarts), report
    assert f["daemon_tracebacks"] == 0 and f["final_daemon_exit_code"] == 0, report
    start, end, tolerance = (f["resources"][k] for k in ("start", "end", "tolerance"))
    assert end["leases"] == 0 and end["registered_instances"] == 0, report
    assert end["fds"] - start["fds"] <= tolerance["fds"], report
    assert end["rss_mib"] - start["rss_mib"] <= tolerance["rss_mib"], report
    assert (tmp_path / "soak.png").stat().st_size > 0
