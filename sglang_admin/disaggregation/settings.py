"""The disaggregation flags' values, their start-up check, and the env-tunable timeouts
(SGLang's names and defaults)."""

from __future__ import annotations

import os

MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "zmq")
DEFAULT_BOOTSTRAP_PORT = 8998
# Health checks and warm-up requests carry this bootstrap host: no bootstrap, no transfer.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


def bootstrap_timeout_s() -> float:
    """How long either side waits for the other to show up for a room (handshake)."""
    return _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)


def waiting_timeout_s() -> float:
    """How long decode waits, after its handshake, for the room's KV to arrive."""
    return _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)


def heartbeat_interval_s() -> float:
    """Decode probes the prefill bootstrap server of rooms it waits for this often."""
    return _env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0)


def heartbeat_max_failures() -> int:
    """Consecutive failed probes after which that prefill is taken for dead."""
    return int(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2))


def transfer_timeout_s() -> float:
    """The most one room's data movement may take once started."""
    return _env_float("SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT", 60.0)


def check_flags(mode: str, backend: str, bootstrap_port: int, *, is_embedding: bool = False,
                speculative_algorithm: str | None = None) -> str | None:
    """None when the disaggregation flags make sense together, else a one-line reason."""
    if mode not in MODES:
        return f"--disaggregation-mode must be one of {', '.join(MODES)}, got {mode!r}"
    if backend not in TRANSFER_BACKENDS:
        return (f"--disaggregation-transfer-backend must be one of "
                f"{', '.join(TRANSFER_BACKENDS)}, got {backend!r}")
    if not 1 <= bootstrap_port <= 65535:
        return f"--disaggregation-bootstrap-port must be in 1..65535, got {bootstrap_port}"
    if mode == "null":
        return None
    if is_embedding:
        return "--disaggregation-mode prefill/decode serves generation; not with an embedding model"
    if backend == "mooncake":
        import importlib.util

        if importlib.util.find_spec("mooncake") is None:
            return ("--disaggregation-transfer-backend mooncake needs the mooncake transfer "
                    "engine (pip install mooncake-transfer-engine-non-cuda; see docs/pd.md), "
                    "or use --disaggregation-transfer-backend zmq")
    if mode == "prefill" and speculative_algorithm:
        return ("--speculative-algorithm runs on the decode worker of a PD pair; "
                "start the prefill worker without it")
    for name in ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                 "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
                 "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT"):
        try:
            _env_float(name, 1.0)
        except ValueError as exc:
            return str(exc)
    return None
