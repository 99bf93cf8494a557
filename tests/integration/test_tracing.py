"""W3C trace context: the caller's trace id reaches the server span and the scheduler logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"

# Runs in a child process: the server in its main thread (it owns the signal handlers)
# with the OpenTelemetry SDK's in-memory exporter; a client thread calls FlushCache with a
# traceparent, then sends SIGTERM so the server exits and the spans can be read.
_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import grpc
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from sglang_admin.config import ServerArgs
    from sglang_admin.logging_utils import setup_logging
    from sglang_admin.server.launch import serve
    from sglang_admin.pb import common_pb2 as pb, common_pb2_grpc as pb_grpc

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    port = int(sys.argv[1]); traceparent = sys.argv[2]
    result = {}

    def client():
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for _ in range(600):
            try:
                if stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        resp = stub.FlushCache(pb.FlushCacheRequest(timeout_s=5), timeout=30,
                               metadata=[("traceparent", traceparent)])
        result["flush_success"] = resp.success
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=client, daemon=True).start()
    setup_logging("info")
    code = serve(ServerArgs(port=port, log_requests=True))
    result["exit_code"] = code
    result["spans"] = [
        {"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
         "kind": s.kind.name,
         "parent_trace_id": format(s.parent.trace_id, "032x") if s.parent else None}
        for s in exporter.get_finished_spans()
    ]
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def test_traceparent_reaches_server_span_and_scheduler_log() -> None:
    pytest.importorskip("opentelemetry.sdk")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(free_port()), TRACEPARENT],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    assert result["flush_success"] is True
    assert result["exit_code"] == 0
    flush_spans = [s for s in result["spans"] if s["name"] == "FlushCache"]
    assert flush_spans, result["spans"]
    assert flush_spans[0]["trace_id"] == TRACE_ID
    assert flush_spans[0]["kind"] == "SERVER"
    # The scheduler rank (another process) logs the op with the caller's trace id.
    rank_lines = [
        ln for ln in proc.stderr.splitlines() if "[rank0]" in ln and "flush_cache" in ln
    ]
    assert rank_lines, proc.stderr[-4000:]
    assert any(f"trace_id={TRACE_ID}" in ln for ln in rank_lines), rank_lines
    # The server logs it too, and both processes name the op by the same request id.
    server_lines = [
        ln for ln in proc.stderr.splitlines()
        if "[server]" in ln and "flush_cache rid=" in ln and f"trace_id={TRACE_ID}" in ln
    ]
    assert server_lines, proc.stderr[-4000:]
    rid = re.search(r"rid=(\S+)", server_lines[0]).group(1)
    assert rid.startswith("admin-")
    assert any(f"rid={rid}" in ln for ln in rank_lines), (rid, rank_lines)
