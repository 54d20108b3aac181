"""The soak's verdicts and report (`scripts/soak/soak.py`): the checks its figures must meet, the
printed report, the figures as JSON and, where matplotlib is installed, the timeline chart."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from soak_client import SHRINK_NOT_TRIED, SHRINK_REFUSED

# Resource tolerances, idle fresh daemon vs idle daemon after the load: the daemon's RSS settles
# within a few MiB (allocator caches, imported code paths); a descriptor or two may be an
# epoll/eventfd that libzmq creates lazily on the first connection.
RSS_TOLERANCE_MIB = 48.0
FD_TOLERANCE = 4


def warm_checks_of(f: dict) -> dict[str, bool]:
    """With --warm-restart: every restart's adopted chunks checked, none wrong, none lost."""
    if f["warm_restart"] is None:
        return {}
    checks = f["warm_restart"]["checks"]
    restarts = [r for r in f["restarts"] if r["signal"] != "SIGSTOP"]
    verified = sum(c["chunks_verified"] for c in checks)
    wrong = sum(c["wrong_bytes"] for c in checks)
    lost = sum(c["lost_chunks"] for c in checks)
    failed = [line for c in checks for line in c["failed"]]
    return {
        f"every restart's adopted chunks read back ({len(checks)} checks of {len(restarts)} restarts, "
        f"{verified} chunks verified, {len(failed)} reads not completed)":
            len(checks) == len(restarts) and verified > 0 and not failed,
        f"0 wrong bytes in adopted chunks ({wrong})": wrong == 0,
        f"0 acknowledged chunks lost by a restart ({lost})": lost == 0,
    }


def min_restarts_checks_of(f: dict) -> dict[str, bool]:
    """With --min-restarts: that many restarts, within the bound the run may be extended to."""
    m = f["min_restarts"]
    if not m["required"]:
        return {}
    bound = f", bound of {m['max_duration_s']:.0f} s reached" if m["bound_reached"] else ""
    return {f"at least {m['required']} daemon restarts ({m['done']}; the run extended by "
            f"{f['extension_s']:.1f} s to {f['duration_s']:.1f} s{bound})": m["done"] >= m["required"]}


def checks_of(f: dict) -> dict[str, bool]:
    start, end = f["resources"]["start"], f["resources"]["end"]
    recovered = [r["recovery_s"] for r in f["restarts"]]
    rss_growth = (end["rss_mib"] or 1e9) - (start["rss_mib"] or 0)
    fd_growth = (end["fds"] or 10**9) - (start["fds"] or 0)
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    forbidden = sum(n for k, n in flood["answers"].items() if k.startswith("a client's"))
    shrinks = shrink["outcomes"]
    return {
        f"work was done ({f['ops'].get('STORE ok', 0)} stores, {f['ops'].get('RETRIEVE ok', 0)} retrieves, "
        f"{f['ops'].get('chunks verified', 0)} chunks verified)":
            f["ops"].get("STORE ok", 0) > 0 and f["ops"].get("chunks verified", 0) > 0,
        f"0 wrong bytes served ({f['wrong_bytes']} in {f['wrong_chunks']} chunks)": f["wrong_bytes"] == 0,
        f"0 requests without a reply ({f['unreplied']} client, {f['garbage']['unreplied']} malformed, "
        f"{flood['unanswered']} CANCEL_TRANSFERS of the flood)":
            f["unreplied"] == 0 and f["garbage"]["unreplied"] == 0 and flood["unanswered"] == 0,
        f"CANCEL_TRANSFERS floods answered as bounded ({flood['floods']} floods; {forbidden} for a client's "
        f"instance; {len(flood['failures'])} answers other than a count, OVERLOADED or FORBIDDEN)":
            not flood["failures"],
        f"every ftruncate of a registered cache refused ({shrinks.get(SHRINK_REFUSED, 0)} of "
        f"{sum(n for k, n in shrinks.items() if k != SHRINK_NOT_TRIED)}; exit {shrink['exit_code']})":
            set(shrinks) <= {SHRINK_REFUSED, SHRINK_NOT_TRIED} and shrink["exit_code"] == 0,
        f"served while idle connections were held ({idle['served_meanwhile']} in {idle['rounds']} rounds)":
            not idle["failures"] and idle["served_meanwhile"].get("STATUS failed", 0) == 0,
        f"no timeout while the daemon was up ({f['timeouts_while_daemon_up']})":
            f["timeouts_while_daemon_up"] == 0,
        f"no client hung or crashed ({f['clients_hung']} hung, {f['clients_crashed']} crashed)":
            f["clients_hung"] == 0 and f["clients_crashed"] == 0,
        f"recovered after every restart ({sum(r is not None for r in recovered)} of {len(recovered)})":
            all(r is not None for r in recovered),
        f"no daemon traceback ({f['daemon_tracebacks']})": f["daemon_tracebacks"] == 0,
        f"daemon RSS flat ({start['rss_mib']:.0f} -> {end['rss_mib'] or 0:.0f} MiB, "
        f"tolerance +{RSS_TOLERANCE_MIB:.0f})": rss_growth <= RSS_TOLERANCE_MIB,
        f"daemon fds flat ({start['fds']} -> {end['fds']}, tolerance +{FD_TOLERANCE})":
            fd_growth <= FD_TOLERANCE,
        f"no lease left ({start['leases']} -> {end['leases']})": end["leases"] == 0,
        f"no registration left ({end['registered_instances']})": end["registered_instances"] == 0,
        f"final daemon stopped cleanly by SIGTERM (exit {f['final_daemon_exit_code']})":
            f["final_daemon_exit_code"] == 0,
        **min_restarts_checks_of(f),
        **warm_checks_of(f),
    }


def print_report(f: dict) -> None:
    extended = (f" (planned {f['planned_duration_s']:.0f} s, extended by {f['extension_s']:.1f} s for "
                f"--min-restarts {f['min_restarts']['required']})" if f["extension_s"] else "")
    print(f"\nsoak of {f['duration_s']:.0f} s{extended} from when the clients served (after "
          f"{f['clients_start_s']:.1f} s), {f['clients_started']} client processes started, "
          f"{f['clients_killed']} SIGKILLed")
    print(f"\n{'operation':<28}{'count':>10}")
    for name, count in sorted(f["ops"].items()):
        print(f"{name:<28}{count:>10}")
    if f["errors"]:
        print(f"\n{'failed (typed) operation':<40}{'count':>8}")
        for name, count in sorted(f["errors"].items()):
            print(f"{name:<40}{count:>8}")
    g = f["garbage"]
    print(f"\nmalformed requests: {g['sent']} sent, {g['unreplied']} unanswered, replies {g['replies']}; "
          f"{g['oversized_sent']} oversized (no reply expected)")
    if g["unreplied_kinds"]:
        print(f"   unanswered: {g['unreplied_kinds']}")
    flood, shrink, idle = (f["attacks"][k] for k in ("cancel_flood", "shrinking_worker", "idle_connections"))
    print(f"cancel floods: {flood['floods']} ({flood['ids_per_request']} request ids a CANCEL_TRANSFERS), "
          f"answers {flood['answers']}")
    print(f"shrinking worker: {shrink['outcomes']}")
    reg_s = idle["registration_s_max"]
    print(f"idle connections: {idle['rounds']} rounds of {idle['per_round']} ZeroMQ + {idle['per_round']} "
          f"attach (opened {idle['opened']}, {idle['attach_closed_by_daemon']} attach closed by the daemon "
          f"first); served meanwhile {idle['served_meanwhile']}; {idle['rounds_put_off']} rounds put off "
          f"(their probe's process still starting)"
          + (f", registration within {reg_s:.2f} s" if reg_s is not None else ""))
    for line in flood["failures"] + idle["failures"]:
        print("  ", line)
    # down: from the signal until the new daemon answered HELLO (stop: until the old one exited);
    # recovery: from then until a client's first STORE + read-back of a prompt.
    print(f"\n{'restart at s':>12}{'signal':>9}{'exit':>6}{'stop s':>8}{'down s':>8}{'recovery s':>12}")
    for r in f["restarts"]:
        rec = "NEVER" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        print(f"{r['t']:>12.1f}{r['signal']:>9}{r['exit_code']!s:>6}{r['stop_s']:>8.2f}{r['down_s']:>8.2f}"
              f"{rec:>12}")
    if f["warm_restart"] is not None:
        print_adoption_checks(f["warm_restart"]["checks"])
    start, end = f["resources"]["start"], f["resources"]["end"]
    print(f"\ndaemon at start (fresh) / at end (idle, uptime {end['daemon_uptime_s'] or 0:.0f} s): "
          f"RSS {start['rss_mib']:.1f} / {end['rss_mib'] or 0:.1f} MiB, fds {start['fds']} / {end['fds']}, "
          f"leases {start['leases']} / {end['leases']}")
    if f["wrong_chunks"]:
        print(f"\nwrong chunks served: {f['wrong_chunks']}, under {f['wrong_keys']} distinct keys, "
              f"{f['wrong_keys_stored_by_a_timed_out_store']} of which a STORE that timed out had sent "
              "(the daemon may have run it later, reading blocks the client had reused)")
    for line in f["wrong_examples"] + f["other_reasons"]:
        print("  ", line)


def print_adoption_checks(checks: list[dict]) -> None:
    """Each warm restart: what the new daemon adopted, and what reading it all back found."""
    print(f"\n{'restart at s':>12}{'signal':>9}{'adopted':>9}{'unsealed':>9}{'dropped':>8}{'acked':>7}"
          f"{'verified':>9}{'wrong B':>8}{'lost':>6}{'check s':>8}")
    for c in checks:
        print(f"{c['t']:>12.1f}{c['signal']:>9}{c['adopted_chunks']:>9}{c['adopted_unsealed']:>9}"
              f"{c['dropped_chunks']:>8}{c['acked_prompts']:>7}{c['chunks_verified']:>9}{c['wrong_bytes']:>8}"
              f"{c['lost_chunks']:>6}{c['check_s']:>8.2f}")
        for line in c["failed"] + c["examples"]:
            print("  ", line)


RESTART_STYLES = {"SIGKILL": ("red", "-"), "SIGTERM": ("red", "--"), "SIGSTOP": ("purple", "-")}


def plot(f: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = f["timeline"]
    t = [s["t"] for s in tl]
    rate = [0.0] + [(b["ops"] - a["ops"]) / max(1e-9, b["t"] - a["t"]) for a, b in itertools.pairwise(tl)]
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    series = (("operations/s (all clients)", rate), ("daemon RSS (MiB)", [s["rss_mib"] for s in tl]),
              ("daemon open fds", [s["fds"] for s in tl]), ("leases", [s["leases"] for s in tl]))
    for ax, (label, ys) in zip(axes, series, strict=True):
        ax.plot(t, [float("nan") if y is None else y for y in ys], linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        for r in f["restarts"]:
            color, style = RESTART_STYLES[r["signal"]]
            ax.axvline(r["t"], color=color, linewidth=0.8, linestyle=style)
        for k in f["client_kill_times_s"]:
            ax.axvline(k, color="gray", linewidth=0.6, linestyle=":")
    axes[-1].set_xlabel("seconds (daemon: red SIGKILL, dashed red SIGTERM, purple freeze; "
                        "gray: client SIGKILL)",
                        fontsize=8)
    axes[0].set_title("lmcache-mp chaos soak")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(args: argparse.Namespace, checks: dict[str, bool], figures: dict) -> None:
    """The verdicts; the figures as JSON, always; the chart only where matplotlib is installed
    (a machine without it still gets the figures, and the exit status of the checks)."""
    print()
    for name, ok in checks.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    written = [args.out / "soak.json", *([args.json] if args.json else [])]
    for path in written:
        path.write_text(json.dumps(figures, indent=2))
    try:
        import matplotlib  # noqa: F401  (only the chart needs it)
    except ImportError as err:
        print(f"\nchart skipped: matplotlib cannot be imported ({err})")
    else:
        plot(figures, args.out / "soak.png")
        written.append(args.out / "soak.png")
    print(f"\nwrote {', '.join(map(str, written))}")
