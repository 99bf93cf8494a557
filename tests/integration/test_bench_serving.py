"""tools/bench_serving.py run as a subprocess against a live server, plus its pure parts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, free_port, start_server
from tools import bench_serving

BENCH = ROOT / "tools" / "bench_serving.py"
EXPECTED_KEYS = {
    "backend", "timestamp", "targets", "dataset", "num_prompts", "request_rate",
    "max_concurrency", "completed", "failed", "duration_s", "total_input_tokens",
    "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "cache_hit_rate", "profile_ids", "profile_files", "errors",
} | {
    f"{stat}_{name}_ms"
    for stat in ("mean", "median", "p99")
    for name in ("ttft", "tpot", "itl", "e2e_latency")
}


@pytest.fixture(scope="module")
def bench_server(server: ServerProc, server_profiles: Path) -> tuple[ServerProc, Path]:
    """The session worker (default flags, --profile-dir), its profiles written under a
    directory of this module's own."""
    return server, server_profiles


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_random_and_shared_prefix_runs_print_the_table_and_append_json(
    bench_server: tuple[ServerProc, Path], tmp_path: Path
) -> None:
    srv, _ = bench_server
    out_file = tmp_path / "results.jsonl"
    out = run_bench(
        "--target", srv.target, "--num-prompts", "8", "--random-input-len", "24",
        "--random-output-len", "8", "--random-range-ratio", "1", "--seed", "3",
        "--flush-cache", "--output-file", str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "Serving Benchmark Result" in out.stdout
    assert "Successful requests:                     8" in out.stdout
    assert "Failed requests:                         0" in out.stdout
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "P99 ITL (ms):", "Median (p50) E2E Latency (ms):"):
        assert label in out.stdout
    assert "8/8" in out.stderr  # the progress bar reached the end
    (record,) = read_lines(out_file)
    assert set(record) >= EXPECTED_KEYS
    assert record["completed"] == 8 and record["failed"] == 0 and record["errors"] == []
    assert record["targets"] == [srv.target] and record["dataset"] == "random"
    assert record["request_rate"] is None  # inf: all at once
    assert record["total_input_tokens"] == 8 * 24  # range ratio 1: exact lengths
    assert record["total_output_tokens"] == 8 * 8  # ignore_eos: exact lengths
    assert record["duration_s"] > 0 and record["request_throughput"] > 0
    assert record["output_throughput"] == pytest.approx(64 / record["duration_s"])
    for name in ("ttft", "tpot", "e2e_latency"):
        assert 0 < record[f"median_{name}_ms"] <= record[f"p99_{name}_ms"]
    # ITL is per message that brings tokens: a client that reads late gets a stream's tokens
    # coalesced into one message (coalesce_reads), so no ITL at all (0; seen in a CI run)
    assert 0 <= record["median_itl_ms"] <= record["p99_itl_ms"]
    assert record["mean_ttft_ms"] < record["mean_e2e_latency_ms"]
    assert record["profile_files"] == {}

    # A second run appends a line: shared prefixes, two targets (the same server under two
    # names, round robin), Poisson arrivals and a concurrency limit.
    second_target = f"ipv4:{srv.target}"
    out = run_bench(
        "--target", srv.target, "--target", second_target, "--dataset", "shared-prefix",
        "--shared-prefix-len", "32", "--random-input-len", "8", "--random-output-len", "4",
        "--random-range-ratio", "1", "--num-prompts", "8", "--request-rate", "200",
        "--max-concurrency", "2", "--no-progress", "--output-file", str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "Max request concurrency:                 2" in out.stdout
    first, record = read_lines(out_file)
    assert first["dataset"] == "random"
    assert record["dataset"] == "shared-prefix" and record["completed"] == 8
    assert record["targets"] == [srv.target, second_target]
    assert record["request_rate"] == 200 and record["max_concurrency"] == 2
    assert record["total_input_tokens"] == 8 * 40 and record["total_output_tokens"] == 8 * 4
    # Every prompt starts with the same 32 tokens: the radix cache serves most of them.
    assert record["cache_hit_rate"] > 0.5


def test_profile_run_names_the_trace_files(
    bench_server: tuple[ServerProc, Path], tmp_path: Path
) -> None:
    srv, profile_root = bench_server
    try:
        srv.stub().StopProfile(pb.StopProfileRequest(), timeout=30)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            pytest.skip(f"profiling is not implemented by the server: {exc.details()}")
        raise
    out_file = tmp_path / "profile.jsonl"
    out_dir = profile_root / "bench"
    out = run_bench(
        "--target", srv.target, "--num-prompts", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--random-range-ratio", "1", "--profile",
        "--profile-output-dir", str(out_dir), "--profile-activities", "CPU",
        "--output-file", str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "Profile traces:" in out.stdout
    (record,) = read_lines(out_file)
    assert record["completed"] == 4
    files = record["profile_files"][srv.target]
    assert files and record["profile_ids"][srv.target]
    for name in files:
        assert f"{srv.target}: {name}" in out.stdout
        path = Path(name)
        assert path.is_file() and path.stat().st_size > 0
        assert path.resolve().is_relative_to(out_dir.resolve())
        assert record["profile_ids"][srv.target] in path.name


def test_unreachable_target_fails_cleanly() -> None:
    out = run_bench("--target", f"127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert out.returncode == 1
    assert "GetModelInfo failed: UNAVAILABLE" in out.stderr
    assert "Serving Benchmark Result" not in out.stdout


# ---------------------------------------------------------------------- pure parts


def dataset_args(**kw: object) -> argparse.Namespace:
    return bench_serving.build_parser().parse_args(
        [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    )


FACTS = bench_serving.ModelFacts(vocab_size=261, context_length=8192,
                                 special_ids=frozenset({256, 257, 259, 260}))


def test_datasets_are_seeded_exact_and_avoid_special_tokens() -> None:
    args = dataset_args(num_prompts=20, random_input_len=30, random_output_len=5,
                        random_range_ratio=1, seed=7)
    reqs = bench_serving.build_dataset(args, FACTS)
    assert reqs == bench_serving.build_dataset(args, FACTS)
    assert all(len(r.prompt) == 30 and r.output_len == 5 for r in reqs)
    tokens = {t for r in reqs for t in r.prompt}
    assert tokens <= set(range(261)) - FACTS.special_ids and len(tokens) > 100

    args = dataset_args(dataset="shared-prefix", num_prompts=6, shared_prefix_len=10,
                        shared_prefix_groups=2, random_input_len=4, random_output_len=3,
                        random_range_ratio=0.5)
    reqs = bench_serving.build_dataset(args, FACTS)
    assert reqs[0].prompt[:10] == reqs[2].prompt[:10] == reqs[4].prompt[:10]
    assert reqs[1].prompt[:10] == reqs[3].prompt[:10] != reqs[0].prompt[:10]
    assert all(12 <= len(r.prompt) <= 14 and 1 <= r.output_len <= 3 for r in reqs)

    too_long = dataset_args(num_prompts=1, random_input_len=8000, random_output_len=500,
                            random_range_ratio=1)
    with pytest.raises(ValueError, match="context length 8192"):
        bench_serving.build_dataset(too_long, FACTS)


def test_percentile_and_metrics() -> None:
    assert bench_serving.percentile([], 99) == 0.0
    assert bench_serving.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench_serving.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    ok = bench_serving.RequestResult("t", 10, 4, success=True, output_len=4, cached_tokens=5,
                                     ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1])
    bad = bench_serving.RequestResult("t", 10, 4, error="UNAVAILABLE: gone")
    m = bench_serving.compute_metrics([ok, bad], duration=2.0)
    assert m["completed"] == 1 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 and m["total_output_tokens"] == 4
    assert m["output_throughput"] == 2.0 and m["cache_hit_rate"] == 0.5
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(400.0)


def test_bad_arguments_exit_2() -> None:
    for argv in (["--num-prompts", "0"], ["--request-rate", "0"], ["--random-range-ratio", "2"]):
        with pytest.raises(SystemExit) as exc:
            bench_serving.main(argv)
        assert exc.value.code == 2


def test_api_keys_are_sent(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--api-key", "user-key", "--admin-api-key", "admin-key")
    try:
        common = ["--target", srv.target, "--num-prompts", "2", "--random-input-len", "8",
                  "--random-output-len", "4", "--no-progress", "--flush-cache"]
        out = run_bench(*common)
        assert out.returncode == 1 and "GetModelInfo failed: UNAUTHENTICATED" in out.stderr
        out = run_bench(*common, "--api-key", "user-key")
        assert out.returncode == 1 and "FlushCache failed: UNAUTHENTICATED" in out.stderr
        out = run_bench(*common, "--api-key", "user-key", "--admin-api-key", "admin-key")
        assert out.returncode == 0, out.stderr
        assert "Successful requests:                     2" in out.stdout
    finally:
        srv.stop()
