"""The deployment files in examples/ are consistent with the code they deploy: the compose
file parses, names the real connector and the socket the daemon image listens on, and every
path the Dockerfile copies exists. (No container runtime runs in CI; these checks catch the
drift that breaks such files silently.)"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "examples" / "docker"


def test_compose_starts_vllm_with_the_real_connector_on_the_daemons_socket() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    daemon, vllm = compose["services"]["lmcache-mp"], compose["services"]["vllm"]
    command = vllm["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    module = importlib.import_module(config["kv_connector_module_path"])
    assert hasattr(module, config["kv_connector"])
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
