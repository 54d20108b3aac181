"""Daemon settings: one declaration, four sources (flag > environment > file > default),
checked before anything starts, each refusal one line saying what to change."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lmcache_mp.config import ServerConfig
from lmcache_mp.settings import markdown_table
from lmcache_mp.testing.launcher import start_daemon

ROOT = Path(__file__).resolve().parents[2]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
    return subprocess.run([sys.executable, "-m", "lmcache_mp.cli", "serve", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})


def printed_config(*args: str, env: dict[str, str] | None = None) -> dict:
    out = serve(*args, "--print-config", env=env)
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('chunk_size = 512\nmax_workers = 3\nlease_ttl_s = 5\nl2 = ["disk:///var/tmp/a?size_gb=1"]\n'
                      "insecure_remote = true\n")
    env = {"LMCACHE_MP_CHUNK_SIZE": "1024", "LMCACHE_MP_MAX_WORKERS": "4",
           "LMCACHE_MP_L2": "disk:///var/tmp/b?size_gb=1 disk:///var/tmp/c?size_gb=2"}
    got = printed_config("--config", str(config), "--chunk-size", "64", "--no-insecure-remote", env=env)
    assert got["chunk_size"] == 64  # flag
    assert got["max_workers"] == 4  # environment over file
    assert got["l2"] == ["disk:///var/tmp/b?size_gb=1", "disk:///var/tmp/c?size_gb=2"]
    assert got["lease_ttl_s"] == 5  # file
    assert got["insecure_remote"] is False  # a boolean flag overrides the file both ways
    assert got["queue_deadline_s"] == 10.0  # default
    assert "l2_queue_gb" not in got  # unset: written as a comment


def test_print_config_round_trips_through_config(tmp_path: Path) -> None:
    first = serve("--chunk-size", "128", "--l2", "disk:///var/tmp/x?size_gb=1", "--l2-queue-gb", "0.5",
                  "--listen", f"ipc://{tmp_path}/d.sock", "--listen", "tcp://127.0.0.1:5999",
                  "--log-format", "json", "--metrics-port", "9191", "--print-config")
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "saved.toml"
    saved.write_text(first.stdout)
    second = serve("--config", str(saved), "--print-config")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert tomllib.loads(second.stdout)["listen"] == [f"ipc://{tmp_path}/d.sock", "tcp://127.0.0.1:5999"]


@pytest.fixture
def busy_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


REFUSALS = [
    (["--chunk-size", "100"], {}, "chunk_size (--chunk-size) is 100: must be a positive multiple of 16"),
    (["--l1-size-gb", "100000"], {}, "l1_size_gb (--l1-size-gb) is 100000.0: the machine has only"),
    ([], {"LMCACHE_MP_LEASE_TTL_S": "soon"},
     "environment variable LMCACHE_MP_LEASE_TTL_S is 'soon': expected a number"),
    (["--log-format", "xml"], {}, "invalid choice: 'xml'"),
    ([], {"LMCACHE_MP_LOG_FORMAT": "xml"}, "log_format (--log-format) is 'xml': use one of text, json"),
    (["--lease-ttl-s", "0"], {}, "lease_ttl_s (--lease-ttl-s) is 0.0: must be positive"),
    (["--listen", "ipc:///proc/lmcache-mp.sock"], {},
     "the socket directory /proc (owner uid 0, mode 0555) is open to others"),
    (["--l2", "disk:///proc/kv?size_gb=1"], {},
     "the disk tier's directory of disk:///proc/kv?size_gb=1 (/proc/kv) is not writable"),
    (["--listen", "tcp://10.1.2.3:5555"], {},
     "refusing to listen on tcp://10.1.2.3:5555: it is not a loopback address"),
]


@pytest.mark.parametrize(("args", "env", "message"), REFUSALS)
def test_bad_settings_are_refused_at_start_in_one_line(args: list[str], env: dict[str, str],
                                                       message: str) -> None:
    out = serve(*args, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert message in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_ports_in_use_are_refused_at_start(busy_port: int) -> None:
    for args in (["--listen", f"tcp://127.0.0.1:{busy_port}", "--allow-unauthenticated-tcp"],
                 ["--metrics-port", str(busy_port)]):
        out = serve(*args)
        assert out.returncode == 2
        assert out.stderr.strip() == (
            f"lmcache-mp serve: cannot start: cannot listen on tcp://127.0.0.1:{busy_port}: "
            "Address already in use; choose another port or stop the process that holds it")


def test_config_file_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("pool_gb = 4\n")
    assert "has an unknown setting 'pool_gb'" in serve("--config", str(config)).stderr
    config.write_text('chunk_size = "big"\n')
    assert f"chunk_size in {config} is 'big': expected an integer" in serve("--config", str(config)).stderr
    config.write_text("chunk_size = \n")
    assert "is not valid TOML" in serve("--config", str(config)).stderr
    assert "cannot read the config file" in serve("--config", str(tmp_path / "missing.toml")).stderr


def test_the_configuration_pages_settings_table_is_current() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = re.search(r"<!-- settings table:[^\n]*-->\n(.*?)\n<!-- end of settings table -->", page, re.S)
    assert table is not None and table[1] == markdown_table(ServerConfig), \
        "regenerate docs/configuration.md's settings table: lmcache_mp.settings.markdown_table(ServerConfig)"


def test_json_logs_are_one_object_per_line(short_tmp: Path) -> None:
    daemon = start_daemon(short_tmp, "--l1-size-gb", "0.05", "--log-format", "json")
    assert daemon.stop() == 0
    records = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]
    assert any(r["level"] == "INFO" and " ready " in r["message"] for r in records), records
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
