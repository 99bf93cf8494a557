"""tools/bench_served.py's client against a live worker: every token of the workload comes
back, with all streams at once or a few at a time, and the rank's decode-step phases are
read from GetMetrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProc, free_port, start_server
from tools import bench_served
from tools.workloads import Workload


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp: Path = tmp_path_factory.mktemp("served")
    srv = start_server(tmp, "--enable-metrics", "--metrics-port", str(free_port()))
    yield srv
    srv.stop()


@pytest.mark.parametrize("concurrency", [0, 2])
def test_the_client_receives_every_token(metrics_server: ServerProc, concurrency: int) -> None:
    work = Workload("small", [[1, 2, 3, 4] * (i + 1) for i in range(6)], [3, 5, 1, 8, 2, 6])
    out = asyncio.run(bench_served._drive(metrics_server.target, work, concurrency))
    assert out["tokens"] == work.output_tokens
    assert out["seconds"] > 0


def test_the_rank_reports_its_decode_phases(metrics_server: ServerProc) -> None:
    work = Workload("small", [[5, 6, 7]] * 4, [6] * 4)
    asyncio.run(bench_served._drive(metrics_server.target, work))
    phases = bench_served._step_timing(metrics_server.target)
    assert phases.pop("steps") >= 5
    assert set(phases) == {"schedule", "prepare", "model", "sample", "postprocess", "output"}
    assert phases["model"] > 0 and all(v >= 0 for v in phases.values())
