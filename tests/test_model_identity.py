"""The model's identity: the chunk key covers every setting that changes the weights' KV (issue 25
item 2).

vLLM's own configuration objects, built by vLLM from its engine arguments for a real (tiny,
random) checkpoint: engines configured alike get one identity, engines whose weights or their
reading differ (revision, dtype, quantization, rope settings through --hf-overrides) another,
so they never share a chunk. A real engine with another rope setting against a daemon holding
the first engine's chunks: test_vllm_connector.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm.engine.arg_utils import EngineArgs

from vllm_adapter.model_identity import model_identity

REPO = Path(__file__).resolve().parents[1]
ROPE = {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}
SETTINGS_THAT_CHANGE_KV: dict[str, dict[str, Any]] = {
    "dtype": {"dtype": "bfloat16"},
    "revision": {"revision": "v2"},
    "code revision": {"code_revision": "v2"},
    "quantization": {"quantization": "fp8"},
    "rope theta (hf_overrides)": {"hf_overrides": ROPE},
    "rope scaling (hf_overrides)": {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("identity") / "tiny-llama"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out), "--dtype",
                    "float32"], check=True, capture_output=True, timeout=120)
    return out


def identity(model: Path, **args: Any) -> str:
    return model_identity(EngineArgs(model=str(model), dtype=args.pop("dtype", "float32"),
                                     **args).create_model_config())


def test_engines_configured_alike_share_one_identity(tiny_model: Path) -> None:
    first = identity(tiny_model)
    assert first == identity(tiny_model)
    assert first.startswith(f"{tiny_model}@")  # the model stays readable in STATUS and logs


@pytest.mark.parametrize("setting", sorted(SETTINGS_THAT_CHANGE_KV))
def test_a_setting_that_changes_the_kv_changes_the_identity(tiny_model: Path, setting: str) -> None:
    assert identity(tiny_model, **SETTINGS_THAT_CHANGE_KV[setting]) != identity(tiny_model)


def test_every_such_setting_gets_an_identity_of_its_own(tiny_model: Path) -> None:
    identities = {identity(tiny_model, **args) for args in SETTINGS_THAT_CHANGE_KV.values()}
    assert len(identities) == len(SETTINGS_THAT_CHANGE_KV)
