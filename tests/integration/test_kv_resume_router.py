"""The real SMG gateway resumes a dropped KV event stream of a worker with two ranks.

The worker (--dp-size 2) runs through tests/kv_stream_cut.py, which ends a stream with
UNAVAILABLE after a batch of the rank the test names. The gateway reconnects with its
cursor; the worker replays what the gateway missed. The gateway must neither clear its
index (no out_of_range or data_loss resync, no "cursor expired"), nor see a gap, and its
index must hold exactly the blocks the worker's ranks hold.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, free_port, wait_serving
from tests.integration.test_smg_router import ANSI, http, metric, stop_router, wait_for


def generate_many(base: str, model: str, first: int, n: int) -> None:
    """n requests at once (so both ranks take some), each a distinct 42-token prompt."""
    def one(i: int) -> int:
        status, body = http("POST", f"{base}/generate", {
            "model": model, "input_ids": [i % 250 + 1, *range(10, 51)],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        })
        assert status == 200, body
        return status
    with cf.ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(first, first + n)))


def worker_blocks(worker: ServerProc) -> dict[int, int]:
    """Each rank's live blocks, from the snapshot a fresh subscription opens with."""
    blocks: dict[int, int] = {}
    stream = worker.stub().SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=10)
    for batch in stream:
        if not batch.HasField("snapshot"):
            continue
        blocks[batch.dp_rank] = batch.snapshot.blocks
        if batch.dp_rank == 1 and batch.snapshot.index + 1 == batch.snapshot.count:
            break
    stream.cancel()
    return blocks


# long: run alone (make test-long), not beside the parallel suite. Beside it the gateway,
# health-probing every 2 s, sometimes subscribed afresh from 0 between the test's count and
# its cut (two of three fresh-clone runs of the full suite on 2026-12-05; alone, never)
@pytest.mark.long
def test_a_dropped_stream_resumes_without_clearing_the_index(tmp_path: Path) -> None:
    from sglang_admin.model.default_model import ensure_default_model

    model = str(ensure_default_model())
    cut = tmp_path / "cut"
    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "kv_stream_cut.py"), "serve",
             "--port", str(port), "--model-path", model, "--dp-size", "2",
             "--grpc-http-sidecar-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "KV_STREAM_CUT": str(cut),
                 "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )
    worker = ServerProc(proc, port, log_path)
    router = None
    try:
        wait_serving(worker.target, proc)
        rport, mport = free_port(), free_port()
        router_log = tmp_path / "router.log"
        with open(router_log, "w") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "smg.launch_router",
                 "--worker-urls", f"grpc://127.0.0.1:{port}",
                 "--host", "127.0.0.1", "--port", str(rport),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
                 "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
                 "--log-level", "info", "--worker-warmup-secs", "0",
                 "--worker-warmup-divert-every", "0"],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"},
            )
        base = f"http://127.0.0.1:{rport}"
        metrics = type("M", (), {"metrics": f"http://127.0.0.1:{mport}"})()
        url = f"grpc://127.0.0.1:{port}"

        def router_log_text() -> str:
            return ANSI.sub("", router_log.read_text(errors="replace"))

        def healthy() -> bool:
            assert router.poll() is None, router_log_text()[-3000:]
            try:
                status, body = http("GET", f"{base}/workers", timeout=5)
            except OSError:
                return False  # not listening yet
            return status == 200 and any(w.get("is_healthy") for w in body.get("workers", []))

        wait_for(healthy, 90, "the worker healthy behind the gateway")
        generate_many(base, model, 0, 6)
        blocks = worker_blocks(worker)
        assert blocks.get(0, 0) > 0 and blocks.get(1, 0) > 0, blocks  # both ranks cached

        def caught_up() -> bool:
            """The gateway's index holds the worker's blocks (both read again each time:
            a request's events may still be on their way when its answer comes)."""
            held = metric(metrics, "smg_kv_index_blocks").get(url)
            return held is not None and held == sum(worker_blocks(worker).values())

        wait_for(caught_up, 20, "the gateway's index to hold the worker's blocks")

        def connections() -> list[str]:
            return re.findall(r"KV event stream connected.*start_seq=(\d+)", router_log_text())

        # (a loaded gateway may have subscribed again before any event came, from 0: what
        # counts is the subscription after the cut, and no resync caused by it)
        before = len(connections())
        snapshots = metric_by(metrics, "smg_kv_event_resyncs_total", "reason").get("snapshot", 0)
        assert snapshots >= 1, "the first subscription opens with a snapshot"

        # drop the stream right after a batch of rank 1, then cause more events on both
        cut.write_text("1")
        first = 100
        while cut.exists():
            assert first < 400, "no batch of rank 1 came to cut the stream after"
            generate_many(base, model, first, 6)
            first += 6
        generate_many(base, model, first, 6)

        wait_for(lambda: len(connections()) > before, 20, "the gateway to subscribe again")
        resumed = connections()
        assert len(resumed) == before + 1 and int(resumed[before]) > 0, (
            resumed, [line for line in router_log_text().splitlines() if "KV event" in line])

        try:
            wait_for(caught_up, 20, "the gateway's index to hold the worker's blocks")
        except AssertionError:
            print(metric(metrics, "smg_kv_index_blocks"), worker_blocks(worker),
                  router_log_text()[-6000:])
            raise
        log = router_log_text()
        assert "replay cursor expired" not in log
        resyncs = metric_by(metrics, "smg_kv_event_resyncs_total", "reason")
        assert resyncs.get("out_of_range", 0) == 0 and resyncs.get("data_loss", 0) == 0, resyncs
        assert resyncs.get("snapshot", 0) == snapshots, resyncs  # none since the cut
        gaps = metric_by(metrics, "smg_kv_event_gaps_total", "outcome")
        assert sum(gaps.values()) == 0, gaps
    finally:
        if router is not None:
            stop_router(router)
        worker.stop(signal.SIGTERM, timeout=30)


def metric_by(metrics, name: str, label: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{metrics.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf'{name}\{{[^}}]*{label}="([^"]*)"[^}}]*\}} (\S+)', text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out
