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
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm.config import ModelConfig

# Configuration entries that say nothing about the KV: the library version that wrote it.
_NOT_KV = frozenset({"transformers_version"})


def model_identity(model_config: ModelConfig) -> str:
    """`MODEL@DIGEST`: the model as vLLM names it, and 16 hex digits of what shapes its KV."""
    settings = {
        "revision": model_config.revision,
        "code_revision": model_config.code_revision,
        "model_weights": model_config.model_weights,
        "dtype": str(model_config.dtype),  # of the weights (the KV cache's is in the format)
        "quantization": model_config.quantization,
        "hf_config": _config_entries(model_config.hf_config),
    }
    encoded = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":")).encode()
    return f"{model_config.model}@{hashlib.sha256(encoded).hexdigest()[:16]}"


def _config_entries(hf_config: Any) -> dict[str, Any]:
    return {name: value for name, value in hf_config.to_dict().items() if name not in _NOT_KV}
