"""The connector found by name alone: vLLM's own plugin loader runs our entry point, and vLLM's
connector factory then resolves `"kv_connector": "LMCacheMPDaemonConnector"` with no module path
(a real engine started that way: tests/vllm/test_vllm_connector.py); and the connector requires no
KV cache layout of vLLM (`get_required_kvcache_layout`): every real-engine test runs vLLM's own."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

config = KVTransferConfig(kv_connector="LMCacheMPDaemonConnector", kv_role="kv_both")
try:
    KVConnectorFactory.get_connector_class(config)
except ValueError as e:
    print("before plugins:", e)
load_general_plugins()
from vllm_adapter.plugin import register
register()  # vLLM may load plugins more than once in a process
cls = KVConnectorFactory.get_connector_class(config)
print("after plugins:", cls.__module__, cls.__name__, KVConnectorFactory.supports_hma_config(config))

# The KV cache layout vLLM's workers take with the connector configured: none asked of vLLM.
from types import SimpleNamespace
from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
print("layout required:", get_kv_connector_cache_layout(SimpleNamespace(kv_transfer_config=config)))
"""


def test_vllms_plugin_loader_registers_the_connector_by_name() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "before plugins: Unsupported connector type: LMCacheMPDaemonConnector" in out.stdout, out.stdout
    assert "after plugins: vllm_adapter.connector LMCacheMPDaemonConnector True" in out.stdout, out.stdout
    assert "layout required: None" in out.stdout, out.stdout
