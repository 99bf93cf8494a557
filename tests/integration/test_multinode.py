"""One replica over two nodes on this machine: two ``sglang-admin serve`` process trees
started separately with ``--nnodes 2 --tp-size 2``, joined over 127.0.0.1.

Node 1 runs in a mount namespace of its own when the machine allows one (``unshare -m``,
as root): a directory there is hidden under an empty tmpfs, so a refit path that node 0's
disk has and node 1's lacks is a real case, not a simulation. The tests: the join check
(flags, settings that disagree, a node that never joins); greedy tokens and logprobs equal
to tp 1 on the embedded model; sampling, n > 1 and stop strings at tp 2 over 2 nodes; the
admin RPCs across the nodes; node 1 killed mid-stream and node 0 killed, with no process left.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, ServerProc, free_port, greedy, run_generate, wait_serving
from tests.integration.test_faults import assert_gone

PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28], list(range(40, 140)), [7] * 17]
NEW_TOKENS = [12, 20, 8, 16]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


UNSHARE = _can_unshare()


@dataclass
class Node:
    """One node's serve process (the leader of its own process group)."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    http_port: int = 0  # its HTTP sidecar (node >= 1: /health and /metrics)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[int]:
        """The serve process and every process below it."""
        out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
        children: dict[int, list[int]] = {}
        for line in out.stdout.split("\n"):
            if line.strip():
                pid, ppid = map(int, line.split())
                children.setdefault(ppid, []).append(pid)
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children.get(pid, [])
        return found

    def kill_host(self) -> None:
        """Every process of this node at once, as a host that loses power."""
        os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_host()
                self.proc.wait(10)


def start_node(tmp: Path, rank: int, init_port: int, *extra: str, nnodes: int = 2,
               tp: int = 2, hide: Path | None = None, port: int | None = None) -> Node:
    """``sglang-admin serve`` as node ``rank`` of ``nnodes``; ``hide``: a directory this
    node sees empty (its own mount namespace)."""
    port = port or free_port()
    http_port = free_port()
    log_path = tmp / f"node{rank}-{port}.log"
    cmd = [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
           "--grpc-http-sidecar-port", str(http_port), "--tp-size", str(tp),
           "--nnodes", str(nnodes), "--node-rank", str(rank),
           "--dist-init-addr", f"127.0.0.1:{init_port}", "--max-total-tokens", "2048",
           "--dist-timeout", "120", *extra]
    if hide is not None:
        script = f"mount -t tmpfs tmpfs {hide} && exec \"$@\""
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                start_new_session=True)
    node = Node(proc, port, log_path, http_port)
    STARTED.append(node)
    return node


def init_port() -> int:
    """A --dist-init-addr port whose next port (replica 0's TP group) is free too."""
    while True:
        port = free_port()
        if port < 65000:
            try:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def wait_both(nodes: list[Node], timeout: float = 240) -> None:
    for node in nodes:
        try:
            wait_serving(node.target, node.proc, timeout)
        except Exception:
            for n in nodes:
                if n.proc.poll() is None:
                    n.kill_host()
            raise RuntimeError("nodes failed to start:\n" +
                               "\n".join(n.log()[-3000:] for n in nodes)) from None


@dataclass
class Pair:
    node0: Node
    node1: Node
    hidden: Path | None  # a directory node 1 sees empty (None: no mount namespace here)

    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(self.node0.target))


STARTED: list[Node] = []  # every node a test started: none outlives it (see below)


@pytest.fixture(autouse=True)
def no_node_left() -> Iterator[None]:
    """A test that fails half-way leaves no process of its nodes behind (the module's
    pair, stopped at the module's end, excepted)."""
    before = len(STARTED)
    yield
    for node in STARTED[before:]:
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)  # the group outlives its leader
        except ProcessLookupError:
            pass
    del STARTED[before:]


def start_pair(tmp: Path, *extra: str) -> Pair:
    hidden = tmp / "hidden-on-node1"
    hidden.mkdir(exist_ok=True)
    port = init_port()
    node0 = start_node(tmp, 0, port, *extra)
    node1 = start_node(tmp, 1, port, *extra, hide=hidden if UNSHARE else None)
    return Pair(node0, node1, hidden if UNSHARE else None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("multinode")
    # the profiles' root: node 1 writes its traces into its own (empty) view of it
    p = start_pair(tmp, "--enable-lora", "--max-lora-rank", "8", "--enable-metrics",
                   "--profile-dir", str(tmp / "hidden-on-node1" / "profiles"))
    del STARTED[-2:]  # the module's: stopped below, not after the test that started them
    wait_both([p.node0, p.node1])
    yield p
    pids = p.node0.tree() + p.node1.tree()
    try:
        p.node0.stop()
        assert p.node0.proc.returncode == 0, p.node0.log()[-3000:]
        p.node1.proc.wait(30)
        assert p.node1.proc.returncode == 0, p.node1.log()[-3000:]  # stopped by node 0
        assert_gone(pids)
    finally:
        for node in (p.node0, p.node1):
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------ the join check


def test_wrong_flag_combinations_are_refused_in_one_line(tmp_path: Path) -> None:
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
    ]
    for args, text in cases:
        out = subprocess.run([sys.executable, "-m", "sglang_admin", "serve", *args],
                             capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2, (args, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and text in lines[0], (args, out.stderr)


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


# ------------------------------------------------------------------ generation


def test_greedy_tokens_and_logprobs_equal_tp1(pair: Pair, server: ServerProc) -> None:
    def run_all(stub):
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched, chunked, decoded
            futures = [pool.submit(run_generate, stub, greedy(p, n, return_logprob=True),
                                   timeout=180) for p, n in zip(PROMPTS, NEW_TOKENS)]
            return [f.result() for f in futures]

    ours, ref = run_all(pair.stub()), run_all(server.stub())
    for (tokens, complete), (ref_tokens, ref_complete), n in zip(ours, ref, NEW_TOKENS):
        assert tokens == ref_tokens and len(tokens) == n
        a = list(complete.output_logprobs.token_logprobs)
        b = list(ref_complete.output_logprobs.token_logprobs)
        assert len(a) == n and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_sampling_n_and_stop_strings_across_nodes(pair: Pair, server: ServerProc) -> None:
    stub = pair.stub()
    # sampling: n = 3 completions, each of its own length, tokens from the vocabulary
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPTS[0]),
        sampling_params=pb.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, n=3,
                                          max_new_tokens=10, ignore_eos=True))
    completes = [r.complete for r in stub.Generate(req, timeout=180) if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(len(c.output_ids) == 10 for c in completes)
    # a stop string ends the output where tp 1 ends it
    text_req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPTS[1], original_text="x"),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    full, _ = run_generate(server.stub(), text_req, timeout=180)
    import transformers  # the stop string: the text of tp 1's 5th and 6th tokens

    from sglang_admin.model.default_model import ensure_default_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_default_model())
    stop = tokenizer.decode(full[4:6])
    if not stop.strip():
        pytest.skip("the 5th/6th tokens decode to whitespace")
    stop_req = pb.GenerateRequest()
    stop_req.CopyFrom(text_req)
    stop_req.sampling_params.stop.append(stop)
    ours, complete = run_generate(stub, stop_req, timeout=180)
    theirs, ref_complete = run_generate(server.stub(), stop_req, timeout=180)
    assert ours == theirs and len(ours) < 20
    assert complete.matched_stop_str == ref_complete.matched_stop_str == stop


# ------------------------------------------------------------------ admin across nodes


def test_server_info_lists_every_tp_rank_with_its_node(pair: Pair) -> None:
    info = pair.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert info.server_args["nnodes"] == 2 and info.server_args["tp_size"] == 2
    ranks = [(int(r["tp_rank"]), int(r["node_rank"])) for r in info.scheduler_info["tp_ranks"]]
    assert ranks == [(0, 0), (1, 1)]
    assert [(t.tp_rank, t.node_rank) for t in info.rank_states[0].tp_ranks] == [(0, 0), (1, 1)]
    # node 1: health and GetServerInfo only, on its own --port
    ch = grpc.insecure_channel(pair.node1.target)
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub1 = pb_grpc.SglangSchedulerStub(ch)
    info1 = stub1.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info1.scheduler_info["node_rank"] == 1
    local = info1.scheduler_info["local_ranks"]
    assert [(int(r["tp_rank"]), r["alive"]) for r in local] == [(1, True)]
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub1, greedy([1, 2, 3], 2), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # node 1's own /health and /metrics on its sidecar port
    import urllib.request

    base = f"http://127.0.0.1:{pair.node1.http_port}"
    with urllib.request.urlopen(f"{base}/health", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'sglang_admin_node_rank_alive{dp_rank="0",node_rank="1",tp_rank="1"} 1.0' in text
    assert 'sglang_admin_node_link_up{node_rank="1"} 1.0' in text
    assert "sglang_admin_node_rank_heartbeat_age_seconds{" in text


def test_flush_pause_continue_across_nodes(pair: Pair) -> None:
    stub = pair.stub()
    before, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    flushed = stub.FlushCache(pb.FlushCacheRequest(), timeout=60)
    assert flushed.success, flushed.message
    paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="abort"), timeout=60)
    assert paused.success, paused.message
    resumed = stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=60)
    assert resumed.success, resumed.message
    after, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    assert after == before


def test_refit_reads_each_nodes_disk(pair: Pair, tmp_path_factory) -> None:
    from sglang_admin.model.default_model import ensure_default_model

    stub = pair.stub()
    before, _ = run_generate(stub, greedy(PROMPTS[2], 8), timeout=120)
    ok = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=ensure_default_model(), weight_version="v2"),
        timeout=180)
    assert ok.success, ok.message
    if pair.hidden is None:
        pytest.skip("no mount namespace here (unshare -m): one disk for both nodes")
    copy = pair.hidden / "ckpt"  # on node 0's disk; node 1 sees the directory empty
    shutil.copytree(ensure_default_model(), copy)
    failed = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(copy), weight_version="v3"), timeout=180)
    assert not failed.success
    assert "TP rank 1 (node 1)" in failed.message and str(copy) in failed.message
    after, _ = run_generate(stub, greedy(PROMPTS[2], 8), timeout=120)
    assert after == before  # the old weights, whole, on both nodes


def test_lora_load_and_unload_across_nodes(pair: Pair, tmp_path_factory) -> None:
    lora_models = pytest.importorskip("tests.lora_models")
    from sglang_admin.model.default_model import ensure_default_model

    adapter = lora_models.build_adapter(Path(ensure_default_model()), "attn",
                                        tmp_path_factory.mktemp("adapter") / "attn", seed=3)
    stub = pair.stub()
    base, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    loaded = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
        lora_name="attn", lora_path=str(adapter), lora_id="attn-1"), timeout=120)
    assert loaded.success, loaded.message
    with_lora, _ = run_generate(stub, greedy(PROMPTS[0], 8, lora_id="attn-1"), timeout=120)
    unloaded = stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_id="attn-1"),
                                      timeout=120)
    assert unloaded.success, unloaded.message
    again, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    assert again == base and with_lora != base


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


# ------------------------------------------------------------------ a saved Llama


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> Iterator[tuple[Pair, Path]]:
    tp_tests = pytest.importorskip("tests.integration.test_tensor_parallel")
    tmp = tmp_path_factory.mktemp("multinode-llama")
    path = tp_tests.build_checkpoint("llama", tmp / "llama")
    p = start_pair(tmp, "--model-path", str(path), "--dtype", "float32",
                   "--max-prefill-tokens", "64")
    del STARTED[-2:]  # the module's: stopped below
    try:
        wait_both([p.node0, p.node1])
        yield p, path
        pids = p.node0.tree() + p.node1.tree()
        p.node0.stop()
        assert p.node0.proc.returncode == 0 and p.node1.proc.wait(30) == 0
        assert_gone(pids)
    finally:
        for node in (p.node0, p.node1):
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_saved_llama_over_two_nodes_equals_transformers(llama_pair) -> None:
    tp_tests = pytest.importorskip("tests.integration.test_tensor_parallel")
    p, path = llama_pair
    srv = ServerProc(p.node0.proc, p.node0.port, p.node0.log_path, [], None)
    tp_tests.assert_equal_to_transformers(srv, tp_tests.hf_model(path), 1)


def test_weights_read_checked_released_and_resumed_across_nodes(llama_pair) -> None:
    tp_tests = pytest.importorskip("tests.integration.test_tensor_parallel")
    p, path = llama_pair
    stub = p.stub()
    full = tp_tests.checkpoint_tensors(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.bias"):
        want = full[name]
        resp = stub.GetWeightsByName(pb.GetWeightsByNameRequest(
            name=name, truncate_size=want.numel()), timeout=60)
        assert resp.success, resp.message
        import torch

        assert torch.equal(torch.tensor(list(resp.values)), want.reshape(-1).float()), name
    check = stub.CheckWeights(pb.CheckWeightsRequest(), timeout=60)
    assert check.success and [r.tp_rank for r in check.rank_results] == [0, 1]
    before, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(), timeout=60)
    assert released.success, released.message
    resumed = stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(), timeout=120)
    assert resumed.success, resumed.message
    again = stub.CheckWeights(pb.CheckWeightsRequest(), timeout=60)
    assert [r.digest for r in again.rank_results] == [r.digest for r in check.rank_results]
    after, _ = run_generate(stub, greedy(PROMPTS[0], 8), timeout=120)
    assert after == before


def test_a_trainer_pushes_to_the_ranks_on_both_nodes(llama_pair) -> None:
    tp_tests = pytest.importorskip("tests.integration.test_tensor_parallel")
    import torch

    from sglang_admin.client.trainer import WeightPusher

    p, path = llama_pair
    model = tp_tests.hf_model(path)
    with torch.no_grad():  # the trainer's step: new weights the workers do not have
        for tensor in model.parameters():
            tensor.mul_(1.25)
    pusher = WeightPusher([p.node0.target], timeout_s=120)
    pusher.join("127.0.0.1", init_port(), group_name="multinode-weights")
    try:
        pusher.push(model.named_parameters(), weight_version="pushed")
    finally:
        pusher.destroy()
    srv = ServerProc(p.node0.proc, p.node0.port, p.node0.log_path, [], None)
    tp_tests.assert_equal_to_transformers(srv, model, 1)  # both TP ranks hold the new shards
    back = p.stub().UpdateWeightsFromDisk(pb.UpdateWeightsFromDiskRequest(
        model_path=str(path)), timeout=180)
    assert back.success, back.message


def test_a_grammar_across_nodes(pair: Pair) -> None:
    """The grammar's matcher stays with TP rank 0 (the followers' samples are discarded):
    sampled outputs match the regex and a JSON schema exactly."""
    constrained = pytest.importorskip("tests.integration.test_constrained")
    import json
    import re

    stub = pair.stub()
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for seed in range(2):
        ids, complete = run_generate(stub, constrained.constrained(regex=pattern, seed=seed),
                                     timeout=180)
        assert re.fullmatch(pattern, constrained.finished_by_grammar(ids, complete))
    schema = json.dumps(constrained.PERSON_SCHEMA)
    ids, complete = run_generate(stub, constrained.constrained(json_schema=schema), timeout=180)
    constrained.check_person(json.loads(constrained.finished_by_grammar(ids, complete)))


def test_the_router_in_front_of_node_0(pair: Pair, tmp_path: Path) -> None:
    """The real SMG gateway registers node 0 as any worker (tp_size 2) and generates
    through it; node 1 is never a worker of its own."""
    smg_tests = pytest.importorskip("tests.integration.test_smg_router")
    from types import SimpleNamespace

    port = free_port()
    log_path = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "smg.launch_router", "--worker-urls",
           f"grpc://{pair.node0.target}", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
           "--log-level", "info"]
    with open(log_path, "w") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, "NO_COLOR": "1"})
    base = f"http://127.0.0.1:{port}"
    gateway = SimpleNamespace(base=base)
    try:
        smg_tests.wait_for(lambda: smg_tests.healthy_workers(gateway), 90,
                           "node 0 healthy in GET /workers")
        _, listing = smg_tests.http("GET", f"{base}/workers")
        worker = listing["workers"][0]
        assert worker["labels"]["tp_size"] == "2"
        gateway.model = worker["model_id"]
        direct, _ = run_generate(pair.stub(), greedy(PROMPTS[1], 6), timeout=120)
        body = smg_tests.generate(gateway, PROMPTS[1], 6)
        assert body["output_ids"] == direct
    finally:
        smg_tests.stop_router(router)


def test_profiles_of_both_nodes_download_from_node_0(pair: Pair) -> None:
    """Each TP rank writes its trace on its own node; node 1's goes to node 0 with its
    StopProfile answer, so DownloadProfile on node 0 returns both (and a merge would
    find both)."""
    import gzip
    import hashlib
    import json

    stub = pair.stub()
    start = stub.StartProfile(pb.StartProfileRequest(output_dir="mn"), timeout=60)
    assert start.success, start.message
    run_generate(stub, greedy(PROMPTS[1], 4), timeout=120)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=180)
    assert stop.success, stop.message
    names = sorted(os.path.basename(f) for f in stop.files)
    assert names == [f"{start.profile_id}-TP-{t}.trace.json.gz" for t in range(2)]
    got: dict[str, bytearray] = {}
    sums: dict[str, str] = {}
    for chunk in stub.DownloadProfile(pb.DownloadProfileRequest(profile_id=start.profile_id),
                                      timeout=120):
        got.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
        if chunk.last:
            sums[chunk.file_name] = chunk.sha256
    assert sorted(got) == names
    for name, data in got.items():
        assert sums[name] == hashlib.sha256(data).hexdigest()
        assert json.loads(gzip.decompress(bytes(data)))["traceEvents"]


def test_smollm2_over_three_nodes_equals_tp1(tmp_path: Path) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads: tp 2 cannot split it) at tp 3 over three nodes,
    each holding one TP rank: greedy tokens and logprobs equal to tp 1's."""
    from sglang_admin.cli import served_model_path
    from tests.conftest import start_server, wait_started

    try:
        model = served_model_path("smollm2")
    except ValueError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")
    common = ("--model-path", str(model), "--dtype", "float32", "--max-prefill-tokens", "64")
    port = init_port()
    nodes = [start_node(tmp_path, k, port, *common, nnodes=3, tp=3) for k in range(3)]
    ref = start_server(tmp_path, *common, "--max-total-tokens", "2048", wait=False)
    try:
        wait_both(nodes)
        wait_started(ref)
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(nodes[0].target))
        ref_stub = ref.stub()
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        assert [int(r["node_rank"]) for r in info.scheduler_info["tp_ranks"]] == [0, 1, 2]
        for prompt, n in zip(PROMPTS[:3], (10, 6, 8)):
            ours, complete = run_generate(stub, greedy(prompt, n, return_logprob=True),
                                          timeout=300)
            theirs, ref_complete = run_generate(ref_stub, greedy(prompt, n,
                                                                 return_logprob=True),
                                                timeout=300)
            assert ours == theirs
            a = list(complete.output_logprobs.token_logprobs)
            b = list(ref_complete.output_logprobs.token_logprobs)
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        pids = [pid for node in nodes for pid in node.tree()]
        nodes[0].stop()
        assert nodes[0].proc.returncode == 0
        assert [node.proc.wait(60) for node in nodes[1:]] == [0, 0]
        assert_gone(pids)
    finally:
        ref.stop()
