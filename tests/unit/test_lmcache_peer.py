"""The peer the lmcache door's tests drive: LMCache's own client, from the lmcache package the test
profile installs (`scripts/setup.sh test`). Without it those tests skip; these two fail, so that a
suite never passes with the door untested, nor against an lmcache whose wire the door does not speak.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest

from lmcache_mp.lmcache_door import wire
from tests.support.helpers import LMCACHE_MISSING

# What the door's tests import of lmcache: its request client, CPU segments and vLLM connector.
CLIENT_MODULES = ("lmcache.v1.multiprocess.transport.zmq_impl", "lmcache.v1.platform.devices.cpu.shm",
                  "lmcache.integration.vllm.lmcache_mp_connector")


def _installed_version() -> str:
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(LMCACHE_MISSING)


def test_lmcache_is_installed_for_the_lmcache_door_s_tests() -> None:
    _installed_version()
    for module in CLIENT_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as err:
            pytest.fail(f"{LMCACHE_MISSING}; importing {module} failed: {err}")


def test_the_installed_lmcache_is_the_version_the_door_speaks() -> None:
    version = _installed_version()
    assert version == wire.LMCACHE_VERSION, (
        f"lmcache {version} is installed; the lmcache door speaks {wire.SPOKEN}. Install "
        f"lmcache=={wire.LMCACHE_VERSION} (`scripts/setup.sh test`), or check that version's wire "
        "(lmcache's transport/zmq_impl/wire.py and transport/base.py) and teach it to the door")
