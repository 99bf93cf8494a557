"""One replica over two nodes on this machine (tests/integration/multinode_nodes.py):
greedy tokens and logprobs equal to tp 1 on the embedded model and to transformers on a
saved Llama; sampling, n > 1, stop strings and grammars at tp 2 over 2 nodes; the admin RPCs
across the nodes (flush, pause, refit from each node's disk, LoRA, weights read back, memory,
a trainer's push, profiles, GetServerInfo); the real SMG gateway in front of node 0.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ROOT, ServerProc, free_port, greedy, run_generate
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

NEW_TOKENS = [12, 20, 8, 16]


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
            kill_group(node)


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


def download(stub, profile_id: str) -> dict[str, bytes]:
    """Every file of profile ``profile_id`` from DownloadProfile, each checked against its
    sha256."""
    import hashlib

    got: dict[str, bytearray] = {}
    sums: dict[str, str] = {}
    for chunk in stub.DownloadProfile(pb.DownloadProfileRequest(profile_id=profile_id),
                                      timeout=120):
        got.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
        if chunk.last:
            sums[chunk.file_name] = chunk.sha256
    assert sorted(sums) == sorted(got)
    for name, data in got.items():
        assert sums[name] == hashlib.sha256(data).hexdigest()
    return {name: bytes(data) for name, data in got.items()}


def test_profiles_of_both_nodes_download_from_node_0(pair: Pair) -> None:
    """Each TP rank writes its trace on its own node; node 1's goes to node 0 with its
    StopProfile answer, so DownloadProfile on node 0 returns both (and a merge would
    find both). A profile that ends by itself (num_steps) has no StopProfile: node 0 asks
    for node 1's traces once its own are written, and until they are there DownloadProfile
    says the profile still runs (never half of it)."""
    import gzip
    import json
    import time

    stub = pair.stub()
    # no Python stacks nor shapes (not what is checked here: tracing every Python call makes
    # each rank's steps and export several times dearer)
    lean = dict(with_stack=False, record_shapes=False)
    start = stub.StartProfile(pb.StartProfileRequest(output_dir="mn", **lean), timeout=60)
    assert start.success, start.message
    run_generate(stub, greedy(PROMPTS[1], 4), timeout=120)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=180)
    assert stop.success, stop.message
    names = sorted(os.path.basename(f) for f in stop.files)
    assert names == [f"{start.profile_id}-TP-{t}.trace.json.gz" for t in range(2)]
    got = download(stub, start.profile_id)
    assert sorted(got) == names
    for data in got.values():
        assert json.loads(gzip.decompress(data))["traceEvents"]

    auto = stub.StartProfile(pb.StartProfileRequest(output_dir="mn-auto", num_steps=2, **lean),
                             timeout=60)
    assert auto.success, auto.message
    run_generate(stub, greedy(PROMPTS[1], 4), timeout=120)
    deadline = time.monotonic() + 120
    while True:
        try:
            got = download(stub, auto.profile_id)
            break
        except grpc.RpcError as exc:  # still exporting, or node 1's traces on their way
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
            assert time.monotonic() < deadline, exc.details()
            time.sleep(0.2)
    assert sorted(got) == [f"{auto.profile_id}-TP-{t}.trace.json.gz" for t in range(2)]
    for data in got.values():
        assert json.loads(gzip.decompress(data))["traceEvents"]


# ------------------------------------------------------------------ a saved Llama
# (last in the module: its pair boots for these tests and stops with the module, so it
# lives less than the 30 s after which a rank imports its late imports)


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
            kill_group(node)


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
    """After the pair served requests and released and resumed its memory (the tests
    above), a trainer's step pushed by WeightPusher reaches both TP ranks: tokens and
    logprobs as transformers' on the trained weights."""
    tp_tests = pytest.importorskip("tests.integration.test_tensor_parallel")
    import torch
    import transformers

    from sglang_admin.client.trainer import WeightPusher

    p, path = llama_pair
    # the trainer's own copy: hf_model(path) is shared, and stays the checkpoint's
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the trainer's step: new weights the workers do not have (with
        for tensor in model.parameters():  # these, EOS comes first once: ignore_eos keeps it)
            tensor.mul_(1.5)
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
    tp_tests.assert_equal_to_transformers(srv, tp_tests.hf_model(path), 1)  # the checkpoint's
