"""The model's identity: the chunk key covers every setting that changes the weights' KV, and
the weight files themselves.

vLLM's own configuration objects, built by vLLM from its engine arguments for a real (tiny,
random) checkpoint: engines configured alike get one identity, engines whose weights or their
reading differ (revision, dtype, quantization, rope settings through --hf-overrides, weights
rewritten in place) another, so they never share a chunk. A real engine with another rope
setting against a daemon holding the first engine's chunks: test_vllm_connector.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from vllm.engine.arg_utils import EngineArgs

from vllm_adapter.model_identity import model_identity, weight_files

REPO = Path(__file__).resolve().parents[2]
LONG_AGO_NS = 1_600_000_000 * 10**9  # September 2020
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
    engine_args = EngineArgs(model=str(model), dtype=args.pop("dtype", "float32"), **args)
    return model_identity(engine_args.create_model_config(), engine_args.create_load_config())


def fine_tune(weights: Path) -> None:
    """Write other weights of the same shapes over `weights`, as a fine-tune saved in place does:
    the same tensor names, shapes and file size, the configuration untouched."""
    with safe_open(weights, "pt") as checkpoint:
        metadata = checkpoint.metadata()
    tensors = load_file(weights)
    save_file({name: tensor + 0.5 for name, tensor in tensors.items()}, weights, metadata=metadata)


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


def written_long_ago(path: Path) -> None:
    """Times of a model written long before this test rewrites it (a rewrite a clock tick after
    the copy could keep its modification time)."""
    os.utime(path, ns=(LONG_AGO_NS, LONG_AGO_NS))


@pytest.fixture
def own_model(tiny_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model that a test may rewrite."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "tiny-llama"))
    written_long_ago(model / "model.safetensors")
    return model


def test_weights_rewritten_in_place_are_another_model(own_model: Path) -> None:
    weights = own_model / "model.safetensors"
    config, size = (own_model / "config.json").read_bytes(), weights.stat().st_size
    before = identity(own_model)
    assert identity(own_model) == before  # the same files: the same identity
    fine_tune(weights)
    assert weights.stat().st_size == size and (own_model / "config.json").read_bytes() == config
    after = identity(own_model)
    assert after != before and identity(own_model) == after


def test_a_rewrite_that_keeps_the_modification_time_is_another_model(own_model: Path) -> None:
    """`cp -p` and `rsync -a` set the modification time back to the source's; the change time
    still tells the files apart."""
    weights = own_model / "model.safetensors"
    before, old = identity(own_model), weights.stat()
    fine_tune(weights)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert weights.stat().st_mtime_ns == old.st_mtime_ns and identity(own_model) != before


def test_a_hub_model_is_known_by_its_cached_snapshot_files(tiny_model: Path, tmp_path: Path) -> None:
    """A hub id (vLLM online: the model stays an id) in the Hugging Face cache's own layout: a
    branch names its commit in refs/, the commit's folder links each file to its blob."""
    commit = "c0ffee" * 6 + "0123"
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    for folder in (snapshot, blobs, repo / "refs"):
        folder.mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for file in tiny_model.iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    written_long_ago(blobs / "model.safetensors")
    cache = str(tmp_path / "hub")
    files = weight_files("org/tiny", None, cache)
    size = (tiny_model / "model.safetensors").stat().st_size
    assert [f[:2] for f in files] == [["model.safetensors", size]]  # the blob's, through the link
    assert weight_files("org/tiny", "main", cache) == weight_files("org/tiny", commit, cache) == files
    fine_tune(blobs / "model.safetensors")
    assert weight_files("org/tiny", None, cache) != files
    # Nothing cached for it: no files (the identity keeps the settings alone).
    assert weight_files("org/tiny", "v2", cache) == weight_files("org/other", None, cache) == []
