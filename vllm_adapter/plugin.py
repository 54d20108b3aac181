"""vLLM's plugin hook: the connector registered by name.

pyproject.toml declares `register` in the `vllm.general_plugins` entry-point group, which vLLM loads
in each of its processes before it builds the connector. So, once lmcache-mp is installed where vLLM
runs, `--kv-transfer-config '{"kv_connector": "LMCacheMPDaemonConnector", "kv_role": "kv_both"}'` is
enough; `kv_connector_module_path` keeps working. An engine started with `VLLM_PLUGINS` set loads only
the plugins it names: add `lmcache_mp` there.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "LMCacheMPDaemonConnector"


def register() -> None:
    """Register the connector with vLLM's factory, lazily (its module loads on first use). vLLM may
    call this more than once in a process: a name already registered is left as it is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_adapter.connector", CONNECTOR_NAME)
    except ValueError:
        logger.debug("%s is registered with vLLM already", CONNECTOR_NAME)
