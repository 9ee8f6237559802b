"""Connector registry: names (EngineArgs.kv_connectors) -> factories building a `KVConnector`.

A factory is `make(ctx: ConnectorContext) -> KVConnector`; it is named here as "module:function" so
that the engine imports a connector's module (NIXL, Mooncake) only when it is configured. A new
connector adds one line to `BUILTIN_CONNECTORS`, or calls `register_connector` before the engine is
built (tests register fakes that way).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from k3serve.workers.engine.kv_connector.base import ConnectorContext, KVConnector

Factory = Callable[[ConnectorContext], KVConnector]

BUILTIN_CONNECTORS: dict[str, str] = {
    "host-offload": "k3serve.workers.engine.kv_connector.host_offload:make_host_offload_connector",
    "nixl": "k3serve.workers.kv_transfer.connector:make_nixl_connector",
    "mooncake-store": "k3serve.kvstore.connector:make_store_connector",
}
_REGISTRY: dict[str, Factory | str] = dict(BUILTIN_CONNECTORS)


def register_connector(name: str, factory: Factory | str) -> None:
    _REGISTRY[name] = factory


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def build_connector(name: str, ctx: ConnectorContext) -> KVConnector:
    try:
        f = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"kv_connectors: unknown connector {name!r} (known: {', '.join(connector_names())})") \
            from None
    if isinstance(f, str):
        mod, _, fn = f.partition(":")
        f = getattr(importlib.import_module(mod), fn)
    return f(ctx)
