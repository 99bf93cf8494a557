"""The PD figures a rank publishes (GetLoads' DisaggregationMetrics and SGLang's PD
Prometheus series, server/metrics.py): the failure counts by the phase the router sorts
failures by, and the figures dict of a role's rooms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FailureCounts:
    """Requests a role ended with an error, by the error's first words: "bootstrap ..."
    (no route, no handshake in time, handshake not sent) or "kv transfer ..." (a failed,
    corrupt, refused or timed-out transfer, a dead peer, a weight version mismatch).
    Aborts, deadlines and grammar errors are neither."""

    bootstrap: int = 0
    transfer: int = 0

    def count(self, error: str) -> None:
        """Count one request ended with ``error``."""
        if error.startswith("bootstrap"):
            self.bootstrap += 1
        elif error.startswith("kv transfer"):
            self.transfer += 1


def rooms_figures(rooms: Any, first_queue: int, second_queue: int) -> dict[str, Any]:
    """The figures of a PrefillRooms or DecodeRooms (``rooms.role``) with its two queue
    sizes: prefill's rooms holding KV for a handshake and in transfer, decode's in
    prealloc/bootstrap and waiting for their KV."""
    out: dict[str, Any] = {
        "mode": rooms.role, "kv_transfer_speed_gb_s": rooms.last_gb_s,
        "kv_transfer_latency_ms": rooms.last_latency_ms,
        "kv_transfer_total_mb": rooms.last_total_mb,
        "kv_transfer_bootstrap_ms": rooms.last_bootstrap_ms,
        "kv_transfer_alloc_ms": getattr(rooms, "last_alloc_ms", 0.0),
        "transfers_ok": rooms.transfers_ok, "transfers_failed": rooms.transfers_failed,
        "bootstrap_failed_reqs": rooms.failures.bootstrap,
        "transfer_failed_reqs": rooms.failures.transfer,
    }
    if rooms.role == "prefill":
        out.update(prefill_prealloc_queue_reqs=first_queue,
                   prefill_inflight_queue_reqs=second_queue)
    else:
        out.update(decode_prealloc_queue_reqs=first_queue,
                   decode_transfer_queue_reqs=second_queue)
    return out
