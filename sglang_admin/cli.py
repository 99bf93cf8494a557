"""`sglang-admin`: `serve` runs a worker; the other subcommands are clients of one or more."""

from __future__ import annotations

import argparse
import logging
import sys

from sglang_admin.config import DEFAULT_PROFILE_MAX_STEPS, ServerArgs, default_profile_dir
from sglang_admin.logging_utils import setup_logging


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a worker (gRPC server + scheduler ranks)")
    p.add_argument("--model-path", help="Hugging Face model directory (default: the embedded model)")
    p.add_argument("--served-model-name", help="model name reported to clients")
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model directory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dp-size", type=_positive_int, default=1, help="scheduler ranks")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    p.add_argument("--max-total-tokens", type=_positive_int, help="KV pool size per rank (tokens)")
    p.add_argument("--max-running-requests", type=_positive_int, default=64)
    p.add_argument("--max-prefill-tokens", type=_positive_int, default=4096,
                   help="prompt tokens prefilled per step (longer prompts are chunked)")
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
    p.add_argument("--grace-period", type=float, default=10.0, dest="grace_period_s",
                   help="seconds in-flight calls get at shutdown")
    p.add_argument("--no-coalesce", dest="coalesce_reads", action="store_false",
                   help="do not share in-flight GetServerInfo/health round trips")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_serve)


def run_serve(ns: argparse.Namespace) -> int:
    from sglang_admin.server.launch import serve

    setup_logging(ns.log_level)
    fields = {k: v for k, v in vars(ns).items() if k not in ("func", "command")}
    if fields["profile_dir"] is None:
        fields.pop("profile_dir")
    if ns.model_path is not None:
        import os

        if not os.path.isdir(ns.model_path):
            print(f"error: --model-path {ns.model_path}: no such directory", file=sys.stderr)
            return 2
    if ns.otlp_traces_endpoint:
        from sglang_admin.otel import configure_otlp

        try:
            configure_otlp(ns.otlp_traces_endpoint)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return serve(ServerArgs(**fields))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-admin",
        description="LLM scheduler worker with a gRPC admin surface, and its client.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    try:
        from sglang_admin.client.commands import add_client_parsers
    except ImportError:
        pass
    else:
        add_client_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
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
