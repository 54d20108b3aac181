"""The model identity every chunk's key covers: the model, and each setting that changes its KV.

vLLM's block hashes cover the tokens (with LoRA, multimodal inputs and the cache salt), not the
weights that turn tokens into KV. Two engines serving the same `--model` with another
`--revision`, `--quantization`, `--dtype`, rope scaling or `--hf-overrides` compute other KV for
the same tokens: keyed by the model name alone, each would be served the other's chunks. The
identity is the model name and a digest of those settings; the workers register under it and
the scheduler looks up under it, so it is part of every chunk's format fingerprint
(`ChunkFormat.model_name`): engines configured alike share every chunk, others none.

The model's configuration is covered whole (after vLLM applied `--hf-overrides` to it), not
field by field: a setting nobody listed here can only split the cache, never mix it.

The weights are covered by what identifies their files cheaply: each weight file's name, size,
modification time and change time (which no tool sets back: `cp -p` and `rsync -a` keep the
modification time). A fine-tune written over the same path with the same configuration is
then another model, to this engine and to one started later against the same warm pool. Their
bytes are not read (a checkpoint may be hundreds of GiB; safetensors headers name the same
tensors of the same shapes after a fine-tune, so they would add nothing a file's size does not).
The files are those of the folder vLLM loads from: `--model` itself when it is a local folder
(or a single file, GGUF), else the snapshot of `--revision` in the Hugging Face cache
(`--download-dir`, or the hub's default) that vLLM downloaded into before the connector
starts. Every weight-like file there counts, not only those vLLM picks: an unused one can only
split the cache. Where no such files can be found (weights streamed from object storage, a
ModelScope download, dummy weights), the identity keeps the settings alone: the revision,
the load format and `model_weights` are among them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hub_constants
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from vllm.config import LoadConfig, ModelConfig

# Configuration entries that say nothing about the KV: the library version that wrote it.
_NOT_KV = frozenset({"transformers_version"})
# The file names vLLM's loaders read weights from (safetensors, PyTorch bins and .pt files).
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def model_identity(model_config: ModelConfig, load_config: LoadConfig) -> str:
    """`MODEL@DIGEST`: the model as vLLM names it, and 16 hex digits of what shapes its KV."""
    settings = {
        "revision": model_config.revision,
        "code_revision": model_config.code_revision,
        "model_weights": model_config.model_weights,
        "dtype": str(model_config.dtype),  # of the weights (the KV cache's is in the format)
        "quantization": model_config.quantization,
        "load_format": str(load_config.load_format),  # dummy weights are not the files'
        "hf_config": _config_entries(model_config.hf_config),
        "weights": weight_files(model_config.model, model_config.revision, load_config.download_dir),
    }
    encoded = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":")).encode()
    return f"{model_config.model}@{hashlib.sha256(encoded).hexdigest()[:16]}"


def weight_files(model: str, revision: str | None, download_dir: str | None) -> list[list[Any]]:
    """Each weight file vLLM may load for `model` (a local path or a hub id) at `revision`: its
    name, size, and modification and change times (ns), sorted; empty if none can be found (see
    the module docstring)."""
    found = _weights_source(model, revision, download_dir)
    if found is None:
        return []
    if found.is_file():
        files = [found]
    else:
        files = sorted({path for pattern in _WEIGHT_PATTERNS for path in found.glob(pattern)})
    return [_file_stamp(path) for path in files]


def _file_stamp(path: Path) -> list[Any]:
    """The file's name, size, and modification and change times (of the blob a hub cache's link
    points at); its name alone if it cannot be read (a dangling link: vLLM does not load it)."""
    try:
        st = path.stat()
    except OSError:
        return [path.name]
    return [path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _weights_source(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The local folder (or single file) vLLM reads the weights of `model` from, if any."""
    local = Path(model)
    if local.exists():
        return local
    return _hub_snapshot(model, revision, download_dir)


def _hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` in the Hugging Face cache (the hub's own
    layout: a branch or tag names its commit in `refs/`, each commit has a folder in
    `snapshots/`), or None if the cache holds none."""
    storage = Path(download_dir or hub_constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id,
                                                                                    repo_type="model")
    revision = revision or hub_constants.DEFAULT_REVISION
    commit = revision
    if not REGEX_COMMIT_HASH.fullmatch(revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:  # never downloaded there (or not a hub id at all)
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _config_entries(hf_config: Any) -> dict[str, Any]:
    return {name: value for name, value in hf_config.to_dict().items() if name not in _NOT_KV}
