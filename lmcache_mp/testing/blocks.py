"""The stand-in workers' geometry (vLLM block and daemon chunk sizes, layers, CPU cache shape) and
vLLM-like block hashes, shared by the tests and the soak. Loads no torch."""

from __future__ import annotations

import hashlib

BLOCK, CHUNK = 16, 32  # vLLM block and daemon chunk sizes of the data-path tests
NUM_BLOCKS, LAYERS = 64, 2
SHAPE = [NUM_BLOCKS, 2, BLOCK, 64]  # the stand-in workers' CPU caches: blocks x heads x tokens x dim


def block_hashes(tokens: list[int]) -> list[bytes]:
    """A vLLM-like chain of block hashes over full blocks."""
    out, prev = [], b"none"
    for i in range(len(tokens) // BLOCK):
        prev = hashlib.sha256(prev + repr(tokens[i * BLOCK:(i + 1) * BLOCK]).encode()).digest()
        out.append(prev)
    return out
