"""KV connectors over kvarn pages: what a request's KV is (:mod:`.carry`), a record store
(:mod:`.store`) and vLLM's connector API over it (:mod:`.storage`). See ``docs/connectors.md``.

Importing this package imports nothing of vLLM: :func:`register` names the connector's module to
vLLM's factory, which imports it when an engine asks for it.
"""

from __future__ import annotations

NAME = "KvarnStorageConnector"
MODULE = "kvarn.vllm.connectors.storage"


def register() -> None:
    """Register ``KvarnStorageConnector`` with vLLM's ``KVConnectorFactory`` (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)


__all__ = ["MODULE", "NAME", "register"]
