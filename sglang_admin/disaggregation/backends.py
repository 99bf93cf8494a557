"""Pick a KV transfer backend by its --disaggregation-transfer-backend name."""

from __future__ import annotations

import importlib

from sglang_admin.disaggregation.transfer import KVTransferBackend, KVTransferError

# name -> "module:Class", imported on use (mooncake's engine is an optional package)
BACKENDS: dict[str, str] = {
    "mooncake": "sglang_admin.disaggregation.mooncake_backend:MooncakeBackend",
    "zmq": "sglang_admin.disaggregation.zmq_backend:ZmqBackend",
}


def make_backend(name: str, host: str) -> KVTransferBackend:
    """A new, not yet started backend; KVTransferError naming the cause when unavailable."""
    target = BACKENDS.get(name)
    if target is None:
        raise KVTransferError(f"unknown kv transfer backend {name!r}; choose one of "
                              f"{', '.join(sorted(BACKENDS))}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KVTransferError(f"kv transfer backend {name!r} is not available: {exc}") from None
    return getattr(module, cls_name)(host=host)
