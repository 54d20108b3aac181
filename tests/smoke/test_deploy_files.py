"""The deployment files in examples/ are consistent with the code they deploy: systemd accepts
the unit and the daemon reads its config file; the compose file parses, names the real
connector and the socket the daemon image listens on, and every path the Dockerfile copies
exists. (No container runtime runs in CI; these checks catch the drift that breaks such files
silently.)"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from lmcache_mp.testing.launcher import daemon_status, start_daemon
from vllm_adapter.plugin import CONNECTOR_NAME

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "examples" / "docker"
SYSTEMD = ROOT / "examples" / "systemd"
INSTALLED_VENV = "/opt/lmcache-mp/.venv"


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/setup.sh test installs it (Debian package systemd)"
    unit = (SYSTEMD / "lmcache-mp.service").read_text()
    assert f"ExecStart={INSTALLED_VENV}/bin/lmcache-mp serve --config /etc/lmcache-mp/config.toml" in unit
    # As installed, but with this checkout's venv where the unit expects /opt/lmcache-mp's.
    (tmp_path / "lmcache-mp.service").write_text(unit.replace(INSTALLED_VENV, str(Path(sys.prefix))))
    out = subprocess.run([analyze, "verify", str(tmp_path / "lmcache-mp.service")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "lmcache-mp.service" not in out.stderr, out.stderr
    for line in ("Type=notify", "NoNewPrivileges=yes", "ProtectSystem=strict", "LimitMEMLOCK=infinity",
                 "RuntimeDirectory=lmcache-mp", "Restart=on-failure"):
        assert f"\n{line}\n" in unit, line


def test_the_units_config_file_is_read_and_matches_the_unit() -> None:
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", "--config",
                          str(SYSTEMD / "config.toml"), "--print-config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    settings = tomllib.loads(out.stdout)
    runtime_dir = re.search(r"^Environment=LMCACHE_MP_RUNTIME_DIR=(\S+)$",
                            (SYSTEMD / "lmcache-mp.service").read_text(), re.M)
    assert runtime_dir is not None and settings["listen"] == [f"ipc://{runtime_dir[1]}/daemon.sock"]
    assert all(url.startswith("disk:///var/lib/lmcache-mp/") for url in settings["l2"])  # StateDirectory


def test_compose_starts_vllm_with_the_real_connector_on_the_daemons_socket() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    daemon, vllm = compose["services"]["lmcache-mp"], compose["services"]["vllm"]
    command = vllm["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    # By name alone: the image pip-installs lmcache-mp, whose vLLM plugin registers the connector.
    assert "kv_connector_module_path" not in config and config["kv_connector"] == CONNECTOR_NAME
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert plugins["vllm.general_plugins"] == {"lmcache_mp": "vllm_adapter.plugin:register"}
    assert config["kv_load_failure_policy"] == "recompute"
    runtime_dir = re.search(r"^ENV LMCACHE_MP_RUNTIME_DIR=(\S+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert runtime_dir is not None
    assert config["kv_connector_extra_config"]["lmcache.mp.url"] == f"ipc://{runtime_dir[1]}/daemon.sock"
    shared = {v for v in daemon["volumes"] if v.endswith(f":{runtime_dir[1]}")}
    assert shared and shared <= set(vllm["volumes"]), "the socket volume must be shared"
    assert daemon["ipc"] == vllm["ipc"] == "host"  # CUDA IPC handles open only within one namespace
    assert vllm["depends_on"]["lmcache-mp"]["condition"] == "service_healthy"


def test_dockerfile_copies_only_what_exists_and_builds_both_targets() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources, "no COPY lines"
    for src in sources:
        assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"
    assert re.findall(r"^FROM \S+ AS (\w+)$", text, re.M) == ["daemon", "vllm"]


def test_readiness_is_notified_once_the_pool_is_ready(short_tmp: Path, monkeypatch) -> None:
    """systemd's side of Type=notify, played by a datagram socket: READY=1 comes after the
    engine is built and the pool is prepared (STATUS=... lines before it show progress),
    STOPPING=1 at SIGTERM."""
    notify_path = short_tmp / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(notify_path))
        systemd.settimeout(60)
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify_path))
        daemon = start_daemon(short_tmp, "--l1-size-gb", "0.5", pool_ready=False)
        try:
            messages = [systemd.recv(4096).decode()]
            while "READY=1" not in messages[-1]:
                messages.append(systemd.recv(4096).decode())
            assert daemon_status(daemon.url).pool_ready, "READY=1 before the pool was ready"
            assert f"STATUS=serving on {daemon.url}" in messages[-1]
            # While starting (no engine yet), then while the pool is prepared, in that order.
            phases = [m.startswith("STATUS=preparing the pool") for m in messages[:-1]]
            assert phases == sorted(phases), messages
            assert all(m.startswith(("STATUS=starting: building the engine", "STATUS=preparing the pool"))
                       for m in messages[:-1]), messages
        finally:
            assert daemon.stop() == 0
        assert systemd.recv(4096) == b"STOPPING=1"
