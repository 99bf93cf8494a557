"""The life of a replica over several nodes (tests/integration/multinode_nodes.py): the
join check (flags, settings that disagree, a node that never joins), three nodes at tp 3
(SmolLM2's head counts, equal to transformers), and the faults: node 1 killed mid-stream, node 0 killed, a stopped
rank on node 1, a stopped node; each with its time to fail and no process left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, greedy, run_generate
from tests.integration.multinode_nodes import (  # noqa: F401  (no_node_left: a fixture)
    PROMPTS,
    STARTED,
    Pair,
    init_port,
    kill_group,
    no_node_left,
    start_node,
    start_pair,
    wait_both,
)
from tests.integration.test_faults import assert_gone

# ------------------------------------------------------------------ the join check


def test_wrong_flag_combinations_are_refused_in_one_line(tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """The first case through the real command (its exit status 2 and one stderr line); the
    others through the same entry point, ``sglang_admin.cli.main``, in this process (a
    Python start each cost more than the check), where a case the flags let through would
    reach ``serve`` and fail here."""
    cases = [
        (["--nnodes", "2"], "needs --dist-init-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"],
         "--node-rank 2 is not in 0..1"),
        (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "127.0.0.1:5000"],
         "--tp-size 3 is the total over the nodes"),
        (["--dist-init-addr", "127.0.0.1:5000"], "--dist-init-addr needs --nnodes > 1"),
        (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1"],
         "expected HOST:PORT"),
        (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:99999"],
         "1..65535"),
        (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:5000",
          "--disaggregation-mode", "prefill"],
         "--disaggregation-mode prefill with --nnodes 2 is not supported"),
    ]
    args, text = cases[0]
    out = subprocess.run([sys.executable, "-m", "sglang_admin", "serve", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, (args, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], (args, out.stderr)

    import logging

    import sglang_admin.server.launch as launch
    from sglang_admin.cli import main

    def not_refused(server_args) -> int:
        raise AssertionError(f"serve was reached: {server_args}")

    monkeypatch.setattr(launch, "serve", not_refused)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    for args, text in cases[1:]:
        try:  # serve's start sets the root logger up for a worker: put this process's back
            try:
                code = main(["serve", *args])
            except SystemExit as exc:  # argparse's refusals
                code = exc.code
        finally:
            root.handlers[:], root.level = handlers, level
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and text in lines[0], (args, err)


def test_nodes_that_disagree_are_refused_on_every_node(tmp_path: Path) -> None:
    port = init_port()
    node0 = start_node(tmp_path, 0, port, "--context-length", "256")
    node1 = start_node(tmp_path, 1, port, "--context-length", "512")
    try:
        assert node0.proc.wait(120) == 2
        assert node1.proc.wait(60) == 2
    finally:
        for n in (node0, node1):
            if n.proc.poll() is None:
                n.kill_host()
    line = "node 1 disagrees with node 0 on context_length: node 0 has 256, node 1 has 512"
    assert line in node0.log() and line in node1.log()


def test_a_node_that_never_joins_fails_node_0_after_the_wait(tmp_path: Path) -> None:
    node0 = start_node(tmp_path, 0, init_port(), "--dist-timeout", "3")
    try:
        started = time.monotonic()
        assert node0.proc.wait(120) == 2
    finally:
        if node0.proc.poll() is None:
            node0.kill_host()
    assert time.monotonic() - started < 60
    assert "node(s) 1 did not join at 127.0.0.1:" in node0.log()
    assert "within --dist-timeout 3s" in node0.log()


# ------------------------------------------------------------------ faults


def _health_watch(target: str, seen: list[int]) -> threading.Thread:
    def watch() -> None:
        try:
            with grpc.insecure_channel(target) as ch:
                for resp in health_pb2_grpc.HealthStub(ch).Watch(
                        health_pb2.HealthCheckRequest(), timeout=120):
                    seen.append(resp.status)
        except grpc.RpcError:
            pass
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_node_1_killed_mid_stream(tmp_path: Path) -> None:
    p = start_pair(tmp_path)
    wait_both([p.node0, p.node1])
    pids = p.node0.tree() + p.node1.tree()
    seen: list[int] = []
    watcher = _health_watch(p.node0.target, seen)
    req = greedy(PROMPTS[0], 2000)
    req.stream = True
    stream = p.stub().Generate(req, timeout=300)
    next(stream)  # tokens are flowing
    p.node1.kill_host()
    killed = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert p.node0.proc.wait(60) != 0
    took = time.monotonic() - killed
    watcher.join(10)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert took < 30, took
    assert "node 1" in p.node0.log()
    assert_gone(pids)


def test_node_0_killed_the_others_exit(tmp_path: Path) -> None:
    p = start_pair(tmp_path)
    wait_both([p.node0, p.node1])
    pids = p.node0.tree() + p.node1.tree()
    run_generate(p.stub(), greedy(PROMPTS[1], 4), timeout=120)
    p.node0.kill_host()
    killed = time.monotonic()
    assert p.node1.proc.wait(60) != 0
    assert time.monotonic() - killed < 30
    assert "node 0" in p.node1.log()
    assert_gone(pids)


def test_a_stopped_rank_on_node_1_ends_both_nodes(tmp_path: Path) -> None:
    p = start_pair(tmp_path, "--watchdog-probe-timeout", "5")
    wait_both([p.node0, p.node1])
    pids = p.node0.tree() + p.node1.tree()
    info = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(p.node1.target)).GetServerInfo(
        pb.GetServerInfoRequest(), timeout=10)
    rank_pid = int(info.scheduler_info["local_ranks"][0]["pid"])
    os.kill(rank_pid, signal.SIGSTOP)
    stopped = time.monotonic()
    assert p.node1.proc.wait(60) != 0
    assert p.node0.proc.wait(60) != 0
    assert time.monotonic() - stopped < 40
    assert "TP rank 1 of replica 0 stopped answering" in p.node1.log()
    assert_gone(pids)


def test_a_stopped_node_is_seen_by_its_silence(tmp_path: Path) -> None:
    p = start_pair(tmp_path)
    wait_both([p.node0, p.node1])
    pids = p.node0.tree() + p.node1.tree()
    os.killpg(p.node1.proc.pid, signal.SIGSTOP)  # the whole host freezes
    stopped = time.monotonic()
    try:
        assert p.node0.proc.wait(90) != 0
        assert time.monotonic() - stopped < 60
        assert "(node 1) silent for" in p.node0.log()
    finally:
        os.killpg(p.node1.proc.pid, signal.SIGCONT)
    assert p.node1.proc.wait(60) != 0  # thawed, it finds node 0 gone and leaves
    assert_gone(pids)


def build_nine_heads(path: Path) -> Path:
    """A tiny random Llama with SmolLM2-135M's head counts (9 query heads, 3 KV heads, tied
    embeddings): tp 2 cannot split it, tp 3 gives each TP rank 3 query heads and 1 KV head.
    Its other sizes are a tiny model's (head_dim 16, 2 layers): what the test checks, the
    heads and the MLP split over three nodes, does not depend on them."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=144, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        max_position_embeddings=512, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a larger init than 0.02 keeps greedy outputs varied
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else None
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_nine_heads_over_three_nodes_equal_transformers(tmp_path: Path) -> None:
    """A model with SmolLM2-135M's 9 heads and 3 KV heads (tp 2 cannot split it) at tp 3
    over three nodes, each holding one TP rank: greedy tokens and logprobs equal to
    transformers' (a 100-token prompt prefills in 64-token chunks); then node 0's stop
    ends all three cleanly."""
    import torch
    import transformers

    from tests.integration.test_tensor_parallel import reference

    path = build_nine_heads(tmp_path / "nine-heads")
    common = ("--model-path", str(path), "--dtype", "float32", "--max-prefill-tokens", "64")
    port = init_port()
    nodes = [start_node(tmp_path, k, port, *common, nnodes=3, tp=3) for k in range(3)]
    # transformers' side while the nodes boot
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cases = list(zip(PROMPTS[:3], (10, 6, 8)))
    refs = [reference(model, prompt, n) for prompt, n in cases]
    wait_both(nodes)
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(nodes[0].target))
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert [int(r["node_rank"]) for r in info.scheduler_info["tp_ranks"]] == [0, 1, 2]
    for (prompt, n), (ref_tokens, ref_logprobs) in zip(cases, refs):
        ours, complete = run_generate(stub, greedy(prompt, n, return_logprob=True),
                                      timeout=300)
        assert ours == ref_tokens
        a = list(complete.output_logprobs.token_logprobs)
        assert len(a) == n and max(abs(x - y) for x, y in zip(a, ref_logprobs)) < 1e-4
    pids = [pid for node in nodes for pid in node.tree()]
    nodes[0].stop()
    assert nodes[0].proc.returncode == 0
    assert [node.proc.wait(60) for node in nodes[1:]] == [0, 0]
    assert_gone(pids)


def test_smollm2_over_three_nodes_equals_tp1(tmp_path: Path) -> None:
    """SmolLM2-135M itself (9 heads, 3 KV heads: tp 2 cannot split it) at tp 3 over three
    nodes, each holding one TP rank: greedy tokens and logprobs equal to a tp 1 worker's
    (dense float32: the precision both share). One prompt: the model's head and shape cuts
    are what this adds to the test above, which checks chunked prefill and the stop."""
    from sglang_admin.cli import served_model_path
    from tests.conftest import start_server, wait_started

    try:
        model = served_model_path("smollm2")
    except ValueError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")
    common = ("--model-path", str(model), "--dtype", "float32", "--gguf-dequantize")
    port = init_port()
    nodes = [start_node(tmp_path, k, port, *common, nnodes=3, tp=3) for k in range(3)]
    ref = start_server(tmp_path, *common, "--max-total-tokens", "2048", wait=False)
    try:
        wait_both(nodes)
        wait_started(ref)
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(nodes[0].target))
        request = greedy(PROMPTS[0], 6, return_logprob=True)
        ours, complete = run_generate(stub, request, timeout=300)
        theirs, ref_complete = run_generate(ref.stub(), request, timeout=300)
        assert ours == theirs
        a = list(complete.output_logprobs.token_logprobs)
        b = list(ref_complete.output_logprobs.token_logprobs)
        assert len(a) == 6 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    finally:
        for node in nodes:
            node.stop()
        ref.stop()
