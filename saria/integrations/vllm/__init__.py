"""saria's vLLM KV connector: ``kv_connector="SariaConnector"``,
``kv_connector_module_path="saria.integrations.vllm"`` (see :mod:`.connector`).

The connector (and with it vLLM) is imported on first use of ``SariaConnector``, so that
``saria serve`` can check its options (:mod:`.settings`, which needs no vLLM) before starting it."""

from __future__ import annotations

from typing import Any

from .settings import ConnectorSettings

__all__ = ["ConnectorSettings", "SariaConnector"]


def __getattr__(name: str) -> Any:
    if name == "SariaConnector":
        from .connector import SariaConnector

        return SariaConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
