"""scripts/make_tiny_model.py: the hybrid archs (Gemma 3 sliding window, Granite MoE-hybrid).

The builder runs as a real subprocess, as the engine tests use it. The vLLM side of these
models (groups, block ids) is in docs/dev/vllm-0.32-connector-notes.md, section 10.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180


def build(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out), *flags],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def config(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text())


def test_gemma3_has_the_requested_sliding_layers_and_is_deterministic(tmp_path: Path) -> None:
    flags = ("--dtype", "float32", "--arch", "gemma3", "--sliding-window", "64",
             "--layer-types", "full,sliding,sliding")
    for name in ("a", "b"):
        assert build(tmp_path / name, *flags).returncode == 0
    cfg = config(tmp_path / "a")
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert (cfg["num_hidden_layers"], cfg["sliding_window"], cfg["head_dim"]) == (3, 64, 32)
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_granitemoehybrid_has_mamba_and_attention_layers(tmp_path: Path) -> None:
    assert build(tmp_path / "m", "--dtype", "float32", "--arch", "granitemoehybrid").returncode == 0
    cfg = config(tmp_path / "m")
    assert cfg["architectures"] == ["GraniteMoeHybridForCausalLM"]
    # transformers stores the Mamba2 layers as "linear_attention", the attention ones as "full_attention".
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert cfg["num_local_experts"] == 0


def test_flags_that_do_not_fit_the_arch_are_refused(tmp_path: Path) -> None:
    cases = {("--layer-types", "full"): "--layer-types needs a hybrid --arch",
             ("--arch", "granitemoehybrid", "--sliding-window", "64"): "--sliding-window needs --arch gemma3",
             ("--arch", "gemma3", "--layer-types", "sliding,local"): "entries must be sliding or full",
             ("--arch", "gemma3", "--layers", "3"): "--layers 3 disagrees with 4 --layer-types entries"}
    for flags, message in cases.items():
        result = build(tmp_path / "x", *flags)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr[-500:])
    assert not (tmp_path / "x").exists()
