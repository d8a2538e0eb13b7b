"""saria's vLLM KV connector: ``kv_connector="SariaConnector"``,
``kv_connector_module_path="saria.integrations.vllm"`` (see :mod:`.connector`)."""

from .connector import SariaConnector
from .settings import ConnectorSettings

__all__ = ["ConnectorSettings", "SariaConnector"]
