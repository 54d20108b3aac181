"""KV dtypes by name: how a torch dtype is spelled in handles, formats and stored chunks.

Its own module so that the wire types (`custom_types.py`) stay free of torch: only the
code that builds or opens a tensor needs this table.
"""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return name


def str_to_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None
