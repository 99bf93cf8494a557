"""Server settings: one frozen dataclass, and every ZMQ address derived from it."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

# Forward steps after which a running profile stops by itself: a forgotten profile's
# events grow the rank's memory and the time its export takes without bound.
DEFAULT_PROFILE_MAX_STEPS = 5000
# --attention-backend: auto (on CPU in float32, a decode step's layers, decode attention,
# prefill attention (chunks up to 1024 tokens), RMSNorm, RoPE and SwiGLU through the C kernels
# of model/cpu_kernels.py when they build, else torch's ops),
# torch_native (torch's ops everywhere), cpu_paged (the kernels, or refuse to start)
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu_paged")
# --mem-fraction-static's default: the share of a GPU's memory that weights + KV pool take.
DEFAULT_MEM_FRACTION_STATIC = 0.85


def default_profile_dir() -> str:
    """Env SGLANG_TORCH_PROFILER_DIR, else a fixed directory under the system temp dir."""
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or os.path.join(
        tempfile.gettempdir(), "sglang_admin_profiles"
    )


def is_inside(path: str, root: str) -> bool:
    """True when ``path`` resolved with symlinks lies inside ``root`` resolved the same way
    (the confinement of profile output to --profile-dir, checked by server and ranks)."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def available_cores() -> int:
    """The cores this process may run on: its affinity mask (a container's cpuset, taskset)
    where the OS has one, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ServerArgs:
    """Every resolved setting of one server instance."""

    model_path: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dp_size: int = 1
    # tensor parallelism (model/tensor_parallel.py): ranks per model replica; the server
    # runs dp_size x tp_size rank processes; on one host a replica's ranks meet through a
    # file in ipc_dir (tp/worker.py's join_replica)
    tp_size: int = 1
    # one replica over several hosts (multinode/): the hosts, this one's index, node 0's
    # HOST:PORT (its link at PORT, replica d's TP group at PORT + 1 + d), and how long a
    # node waits for the others at start
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = 120.0
    device: str = "auto"  # auto | cpu | cuda
    # CUDA: rank r runs on GPU base_gpu_id + r * gpu_id_step (SGLang's assignment), and the
    # KV pool's default size leaves weights + pool within mem_fraction_static of its memory.
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    max_total_tokens: int | None = None  # KV pool size per rank; None: derived
    max_running_requests: int = 64
    # Generate calls in flight at once (running + queued, all ranks); past it a call ends at
    # once with RESOURCE_EXHAUSTED (server/admission.py). 0: derived from
    # --max-running-requests and the KV pool.
    max_inflight_generate: int = 0
    max_prefill_tokens: int = 4096  # prompt tokens prefilled in one step (chunked beyond)
    # A request that waits this long for a place in a full rank (running batch or KV pool)
    # preempts the decode that has run longest (scheduler/preemption.py); 0: never.
    preempt_wait_s: float = 1.0
    context_length: int | None = None  # None: the model's
    log_level: str = "info"
    log_requests: bool = False
    load_balance_method: str = "least_loaded"  # least_loaded | round_robin
    api_key: str | None = field(default=None, repr=False)  # secrets: kept out of repr/logs
    admin_api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    profile_dir: str = field(default_factory=default_profile_dir)
    profile_max_bytes: int = 1 << 30
    profile_max_steps: int = DEFAULT_PROFILE_MAX_STEPS
    otlp_traces_endpoint: str | None = None
    grace_period_s: float = 10.0
    # Connection limits (gRPC server options; 0 turns one off). Idle means no call in
    # flight, so a long stream never counts as idle.
    max_connection_idle_s: float = 300.0
    max_connection_age_s: float = 0.0
    max_connection_age_grace_s: float = 0.0  # 0: calls in flight on an aged connection finish
    keepalive_time_s: float = 60.0  # the server pings a quiet connection this often
    keepalive_timeout_s: float = 20.0  # and drops it when the ping is not answered in time
    # Generate stream buffering: tokens produced but not yet written to a slow reader are
    # coalesced into the next message; past this many the request is aborted with
    # RESOURCE_EXHAUSTED (and its KV freed).
    stream_buffer_tokens: int = 4096
    # The same bound in bytes (tokens with their logprobs and hidden states, as the buffer
    # holds them: server/stream_buffer.py), and the bytes every stream's buffer may hold
    # together: past it new Generate calls are refused with RESOURCE_EXHAUSTED.
    stream_buffer_bytes: int = 256 * 1024
    stream_buffer_bytes_total: int = 64 * 1024 * 1024
    coalesce_reads: bool = True
    # Metrics (server/metrics.py): off unless asked; served by the HTTP sidecar's /metrics
    # and the GetMetrics RPC.
    enable_metrics: bool = False
    # The HTTP sidecar (server/sidecar/): on --host at grpc_http_sidecar_port
    # (SGLang's name; None: the gRPC port + 1, as SGLang's gRPC mode), unless
    # disable_http_sidecar.
    grpc_http_sidecar_port: int | None = None
    disable_http_sidecar: bool = False
    # Watchdog (server/watchdog.py): a rank in one forward step for longer than
    # watchdog_timeout_s, or silent (no heartbeat) for watchdog_probe_timeout_s, is stuck.
    watchdog_timeout_s: float = 300.0
    watchdog_probe_timeout_s: float = 15.0  # a rank in Python work can hold its GIL for seconds
    torch_threads: int = 0  # per lane of a rank; 0: see rank_threads
    cpu_lanes: int = 0  # threads that compute parts of a CPU step at once; 0: see rank_lanes
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    cuda_graph_max_bs: int = 0  # CUDA graphs for decode batches up to this size; 0: off
    # "gguf": a GGUF model's projections kept quantized (model/quant/, docs/gguf.md); "":
    # dense (the dequantizing load of a GGUF file, any other checkpoint)
    quantization: str = ""
    seed: int = 0
    # LoRA (scheduler/ops/lora_control.py): adapters live in --max-loaded-loras slots of rank
    # up to --max-lora-rank; lora_paths are (name, path) pairs loaded at start.
    enable_lora: bool = False
    max_loaded_loras: int = 8
    max_lora_rank: int = 16
    lora_paths: tuple[tuple[str, str], ...] = ()
    # speculative decoding (scheduler/speculative/policy.py; SGLang's flag names). None:
    # off; "NGRAM": drafts by prompt lookup; num_draft_tokens None: its default (8)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_draft_model_path: str | None = None
    # serve a decoder checkpoint as an embedding model (Embed, not Generate)
    is_embedding: bool = False
    # SGLang's --preferred-sampling-params: a JSON object reported as
    # GetModelInfo.preferred_sampling_params (the router's clients read it; checked at start)
    preferred_sampling_params: str | None = None
    # SGLang's --reasoning-parser: the think span's end token of that parser family; a
    # Generate with require_reasoning counts the output tokens up to it as reasoning_tokens
    # (server/reasoning.py)
    reasoning_parser: str | None = None
    # prefill/decode disaggregation (sglang_admin/disaggregation/, docs/pd.md; SGLang's names)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_bootstrap_port: int = 8998  # prefill: its bootstrap HTTP server
    disaggregation_transfer_backend: str = "mooncake"  # mooncake | zmq
    ipc_dir: str = ""  # set by launch: a fresh private directory per instance

    def scheduler_addr(self, rank: int) -> str:
        """Where rank `rank` receives requests (it binds, the server connects)."""
        return f"ipc://{self.ipc_dir}/scheduler-{rank}"

    @property
    def server_addr(self) -> str:
        """Where the server receives every rank's outputs (it binds, ranks connect)."""
        return f"ipc://{self.ipc_dir}/server"

    @property
    def http_sidecar_listen_port(self) -> int:
        """The HTTP sidecar's port: --grpc-http-sidecar-port, or the gRPC port + 1."""
        return self.grpc_http_sidecar_port if self.grpc_http_sidecar_port is not None else self.port + 1

    @property
    def cores_per_rank(self) -> int:
        """The cores this process may run on, shared among this node's ranks (at least
        1; with --nnodes each node runs tp x dp / nnodes of them)."""
        return max(1, available_cores() * self.nnodes // (self.dp_size * self.tp_size))

    @property
    def rank_lanes(self) -> int:
        """Lanes of each rank on CPU (model/runner.py): --cpu-lanes, else one when
        --torch-threads is given (its meaning before lanes: the rank's threads), else 2 when
        a rank has two cores or more. A step's sequences are cut into lanes computed by
        threads of their own that block when done, so a core the server needs now and then
        costs a step only the time the server takes (OpenMP's threads spin on each other
        instead: docs/cpu-performance.md). A decode step of a real-sized model cuts each
        projection's weight rows among the same threads (model/lanes.py): on a loaded
        2-core machine torch's 2 OpenMP threads took 3x-100x one thread's time for the same
        GEMM, the blocking lane threads do not."""
        if self.tp_size > 1:  # every TP rank's all-reduces must come in one order: one lane
            return 1
        if self.cpu_lanes:
            return self.cpu_lanes
        return 1 if self.torch_threads else min(2, self.cores_per_rank)

    @property
    def rank_threads(self) -> int:
        """torch (OpenMP) threads of each lane: --torch-threads, else the rank's cores but
        one (left to the server) shared among its lanes, at least 1. More spinning threads
        than free cores make each wait on descheduled ones: a step then takes several times
        longer (docs/cpu-performance.md)."""
        return self.torch_threads or max(1, (self.cores_per_rank - 1) // self.rank_lanes)

    def gpu_index(self, rank: int) -> int:
        """The CUDA device index of rank ``rank`` (used when the rank runs on CUDA)."""
        return self.base_gpu_id + rank * self.gpu_id_step

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every setting, secrets masked (for GetServerInfo)."""
        out = dataclasses.asdict(self)
        for key in ("api_key", "admin_api_key"):
            out[key] = "***" if out[key] else None
        return out
