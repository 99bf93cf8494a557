"""`serve` flags are checked by argparse: a bad value exits 2 with one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_admin.cli import build_parser, default_served_model_name

ROOT = Path(__file__).resolve().parents[2]

BAD = [
    (["--port", "99999"], "--port: must be a TCP port in 1..65535, got 99999"),
    (["--port", "-5"], "--port: must be a TCP port in 1..65535, got -5"),
    (["--port", "0"], "--port: must be a TCP port in 1..65535, got 0"),
    (["--port", "x"], "--port: must be an integer, got 'x'"),
    (["--dp-size", "0"], "--dp-size: must be a positive integer, got 0"),
    (["--max-inflight-generate", "-1"], "--max-inflight-generate: must be an integer >= 0"),
    (["--seed", "-1"], "--seed: must be an integer in 0..2^63-1, got -1"),
    (["--grace-period", "nan"], "--grace-period: must be a finite number >= 0, got nan"),
    (["--grace-period", "-1"], "--grace-period: must be a finite number >= 0, got -1"),
    (["--max-connection-idle", "inf"], "--max-connection-idle: must be a finite number"),
    (["--max-connection-age", "1e12"], "--max-connection-age: must be at most"),
    (["--keepalive-time", "-3"], "--keepalive-time: must be a finite number >= 0"),
    (["--stream-buffer-tokens", "0"], "--stream-buffer-tokens: must be a positive integer"),
    (["--stream-buffer-bytes", "0"], "--stream-buffer-bytes: must be a positive integer"),
    (["--stream-buffer-bytes-total", "-5"],
     "--stream-buffer-bytes-total: must be a positive integer"),
    (["--torch-threads", "-1"], "--torch-threads: must be an integer >= 0, got -1"),
    (["--preempt-wait", "-1"], "--preempt-wait: must be a finite number >= 0, got -1"),
    (["--served-model-name", "a\nb"], "--served-model-name: must have no control characters"),
    (["--served-model-name", "x\udcff"], "--served-model-name: must be UTF-8 text"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_serve_flag_exits_2_with_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("sglang-admin serve: error: argument ")
    assert expected in err


def test_good_serve_flags_parse() -> None:
    ns = build_parser().parse_args(
        ["serve", "--port", "65535", "--max-connection-idle", "0", "--keepalive-time", "30"]
    )
    assert (ns.port, ns.max_connection_idle_s, ns.keepalive_time_s) == (65535, 0.0, 30.0)


def test_ranks_share_the_cores_in_two_lanes_leaving_one_core(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_admin import config
    from sglang_admin.config import ServerArgs

    for cores, dp, lanes, threads in [(1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 1, 1), (3, 1, 2, 1),
                                      (8, 1, 2, 3), (16, 2, 2, 3), (4, 8, 1, 1)]:
        monkeypatch.setattr(config, "available_cores", lambda cores=cores: cores)
        args = ServerArgs(dp_size=dp)
        assert (args.rank_lanes, args.rank_threads) == (lanes, threads), (cores, dp)
    assert ServerArgs(torch_threads=3, cpu_lanes=1).rank_threads == 3
    assert ServerArgs(cpu_lanes=3).rank_lanes == 3
    # --torch-threads alone keeps its meaning from before lanes: the rank's threads
    only_threads = ServerArgs(torch_threads=2)
    assert (only_threads.rank_lanes, only_threads.rank_threads) == (1, 2)
    both = ServerArgs(torch_threads=2, cpu_lanes=2)
    assert (both.rank_lanes, both.rank_threads) == (2, 2)


def test_cores_are_those_the_process_may_run_on() -> None:
    import os

    from sglang_admin.config import available_cores

    assert available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("port", ["99999", "-5"])
def test_serve_with_a_bad_port_exits_2_with_one_line(port: str) -> None:
    """As a user runs it: `sglang-admin serve --port 99999` (or -5) starts nothing (it
    used to serve on a wrapped port, or start) and prints one line naming the flag."""
    done = subprocess.run(
        [sys.executable, "-m", "sglang_admin", "serve", "--port", port],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"argument --port: must be a TCP port in 1..65535, got {port}" in done.stderr


def test_the_served_model_name_defaults_to_the_model_path_as_given() -> None:
    # SGLang's default: --model-path as the user spelled it, not the directory it resolves to
    assert default_served_model_name("/models/llama-3") == "/models/llama-3"
    assert default_served_model_name("rel/dir") == "rel/dir"
    assert default_served_model_name("tiny.Q4_0.gguf") == "tiny.Q4_0.gguf"
    assert default_served_model_name("smollm2") == "SmolLM2-135M-Instruct"  # the built-in
    assert default_served_model_name("toy") == "toy"
    assert default_served_model_name(None) is None  # the server reports the loaded path


def test_fuzzed_served_model_names_are_refused_or_carried_as_given() -> None:
    """Any name --served-model-name takes goes into GetModelInfo and a metrics label as it
    is; anything else is refused at the flag."""
    import random

    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from sglang_admin.pb import common_pb2 as pb

    rng = random.Random(7)
    alphabet = "aZ09-_./: \t\n\x00\x7f\u00e9\u4e2d\U0001f600\udcff\"'{}"
    refused = 0
    for _ in range(300):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        try:
            ns = build_parser().parse_args(["serve", f"--served-model-name={name}"])
        except SystemExit:
            refused += 1
            assert any(ord(c) < 32 or c == "\x7f" or 0xD800 <= ord(c) < 0xE000 for c in name)
            continue
        assert ns.served_model_name == name
        wire = pb.GetModelInfoResponse(served_model_name=name).SerializeToString()
        assert pb.GetModelInfoResponse.FromString(wire).served_model_name == name
        registry = CollectorRegistry()
        Gauge("g", "g", ["model_name"], registry=registry).labels(name).set(1)
        assert generate_latest(registry)
    assert 0 < refused < 300

