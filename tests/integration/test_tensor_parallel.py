"""--tp-size 2 on CPU (gloo): greedy tokens and logprobs equal transformers' through the
server, with 1 and 2 replicas, on Llama (KV heads split, untied LM head) and Qwen2 (one KV
head replicated on both TP ranks, q/k/v biases, tied); the admin ops reach every TP rank;
a dead TP rank takes the worker down.

Two TP workers cover that matrix: Llama at dp 1 and Qwen2 at dp 2. What an architecture
changes (how its heads, biases and LM head are cut) is inside one replica's TP group, and
what dp 2 changes (requests spread over two TP groups, each replica's ranks and names) does
not depend on the architecture; a worker for each of the four pairs cost two more boots
(six ranks) and checked nothing these two do not."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import (
    ROOT,
    Prestart,
    ServerProc,
    free_port,
    greedy,
    run_generate,
    start_server,
)
from tests.integration.test_faults import assert_gone, wait_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 320
PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28], list(range(40, 140)), [7] * 17]
NEW_TOKENS = [12, 20, 8, 16]


def build_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint: "llama" (4 heads, 2 KV heads, untied LM head, o/MLP
    biases) or "qwen2" (4 heads, 1 KV head, q/k/v biases, tied embeddings)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512,
        eos_token_id=1, bos_token_id=0, pad_token_id=0,
    )
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, num_key_value_heads=1,
                                          tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common, num_key_value_heads=2,
                                          tie_word_embeddings=False, attention_bias=True,
                                          mlp_bias=True)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a larger init than 0.02 keeps greedy outputs varied
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else None
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # random biases: o_proj/down_proj's are added once
                p.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation as the server's ``ignore_eos`` greedy makes it: the
    argmax of the raw logits at every step, EOS included (``generate``'s min_new_tokens
    would mask EOS out, which a server that ignores EOS never does: a model that puts EOS
    first, a trained one for instance, would differ there), and each token's logprob."""
    tokens: list[int] = []
    logprobs: list[float] = []
    ids, past = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(torch.log_softmax(logits, -1)[token].item())
            ids = torch.tensor([[token]])
    return tokens, logprobs


_BUILT: dict[tuple[str, int], Path] = {}
_MODELS: dict[Path, object] = {}


def shared_checkpoint(kind: str, factory: pytest.TempPathFactory, seed: int = 0) -> Path:
    """``build_checkpoint(kind, seed=seed)`` built once per run: the workers and the
    references only read it (a dp 1 and a dp 2 worker of one kind, the killed rank's)."""
    key = (kind, seed)
    if key not in _BUILT:
        _BUILT[key] = build_checkpoint(kind, factory.mktemp(f"{kind}-{seed}") / "ckpt", seed)
    return _BUILT[key]


def hf_model(path: Path):
    """transformers' model of the checkpoint, loaded once per path (read only: its greedy
    references are kept on it, computed once: assert_equal_to_transformers)."""
    if path not in _MODELS:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _MODELS[path] = model.eval()
    return _MODELS[path]


def start_tp(tmp: Path, path: Path, dp: int = 1, *extra: str, wait: bool = True) -> ServerProc:
    return start_server(tmp, "--model-path", str(path), "--dtype", "float32",
                        "--max-prefill-tokens", "64", "--tp-size", "2", "--dp-size", str(dp),
                        "--max-total-tokens", "2048", "--profile-dir", str(tmp / "profiles"),
                        *extra, wait=wait)


def assert_equal_to_transformers(srv: ServerProc, model, dp: int) -> None:
    stub = srv.stub()
    # All prompts at once: batching, chunked prefill (64-token chunks) and decode mix.
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(run_generate, stub,
                        greedy(p, n, return_logprob=True, data_parallel_rank=i % dp),
                        timeout=180)
            for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))
        ]
        results = [f.result() for f in futures]
    # transformers' side once per model object and state of its weights: the tests compare
    # several passes with it, and a test that trains the model in place (a trainer's push)
    # must not be judged against the references of the weights before its step
    state = tuple(p._version for p in model.parameters())
    cached = model.__dict__.get("_greedy_references")
    if cached is None or cached[0] != state:
        cached = model.__dict__["_greedy_references"] = (state, [
            reference(model, prompt, n) for prompt, n in zip(PROMPTS, NEW_TOKENS)])
    refs = cached[1]
    for (tokens, complete), n, (ref_tokens, ref_logprobs) in zip(results, NEW_TOKENS, refs):
        assert tokens == ref_tokens
        ours = list(complete.output_logprobs.token_logprobs)
        assert len(ours) == n
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4


# each architecture at dp 1 and dp 2 (a head cut inside one replica's group, and requests
# spread over two groups, each with the architecture's own biases and LM head)
TP_WORKERS = ["llama-tp2-dp1", "qwen2-tp2-dp1", "llama-tp2-dp2", "qwen2-tp2-dp2"]
# the first TP worker is also the weight-sync, refit, memory and LoRA tests' (sync_worker):
# test_lora.py's flags, its "attn" adapter given at start; requests without an adapter are
# served as by the base model (test_lora.py's mixed batch compares them with transformers)
SYNC_WORKER = TP_WORKERS[0]


@pytest.fixture(scope="module")
def tp_workers_ahead(tmp_path_factory) -> tuple[Prestart, dict[str, Path], dict[str, Path]]:
    """Each TP worker's checkpoint and worker, the next one booting while one's tests run
    (the tests' results do not depend on how the ranks' batches were cut: greedy tokens, a
    1e-4 logprob tolerance, files and weights); and the sync worker's LoRA adapters."""
    from tests.integration.test_lora import SERVER_ARGS
    from tests.lora_models import build_adapter

    paths: dict[str, Path] = {}
    adapters: dict[str, Path] = {}

    def start(name: str) -> ServerProc:
        kind, dp = name.split("-")[0], int(name[-1])
        paths[name] = shared_checkpoint(kind, tmp_path_factory)
        root = tmp_path_factory.mktemp(f"{kind}-srv")
        lora: tuple[str, ...] = ()
        if name == SYNC_WORKER:
            adapters.update({n: build_adapter(paths[name], n, root / n, seed)
                             for seed, n in enumerate(["attn", "mlp"], start=1)})
            adapters["base"] = paths[name]
            lora = (*SERVER_ARGS, "--lora-paths", f"attn={adapters['attn']}")
        return start_tp(root, paths[name], dp, *lora, wait=False)

    return Prestart(TP_WORKERS, start), paths, adapters


@pytest.fixture(scope="module")
def sync_worker(tp_workers_ahead) -> Iterator[tuple[ServerProc, Path, dict[str, Path]]]:
    """The first TP worker (the shared Llama checkpoint: 2 KV heads split, untied LM head,
    biases), kept for the module: the weight-sync, refit, memory and LoRA tests' too, with
    LoRA on, its "attn" adapter (q/k/v/o) given at start and "mlp" (gate/up/down and q)
    loaded at run time. Each test that uses it starts by loading the checkpoint from disk,
    whatever ran before."""
    prestart, paths, adapters = tp_workers_ahead
    srv = prestart.take(SYNC_WORKER)
    yield srv, paths[SYNC_WORKER], adapters
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module", params=TP_WORKERS)
def tp_server(request, tp_workers_ahead) -> Iterator[tuple[ServerProc, object, int, Path]]:
    prestart, paths, _ = tp_workers_ahead
    if request.param == SYNC_WORKER:
        srv, path, _ = request.getfixturevalue("sync_worker")
        load_base(srv, path)  # whatever the sync tests left
    else:
        srv = prestart.take(request.param)
        path = paths[request.param]
    yield srv, hf_model(path), int(request.param[-1]), path
    if request.param != SYNC_WORKER:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_greedy_tokens_and_logprobs_equal_transformers(tp_server) -> None:
    srv, model, dp, _ = tp_server
    info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.server_args["tp_size"] == 2
    assert info.scheduler_info["tp_size"] == 2
    assert len(info.rank_states) == dp
    assert_equal_to_transformers(srv, model, dp)
    # a second pass hits the prefix cache (its KV written by both TP ranks) ...
    assert_equal_to_transformers(srv, model, dp)
    # ... and after a flush (every TP rank forgets its table) the same again
    resp = srv.stub().FlushCache(pb.FlushCacheRequest(), timeout=30)
    assert resp.success, resp.message
    assert_equal_to_transformers(srv, model, dp)


def test_a_bad_request_fails_alone(tp_server) -> None:
    srv, _, _, _ = tp_server
    with pytest.raises(grpc.RpcError) as err:
        run_generate(srv.stub(), pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=[5, 6]),
            sampling_params=pb.SamplingParams(top_p=1.5, max_new_tokens=3)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the server keeps serving: greedy, and sampling with penalties, n = 2 (the followers
    # sample too and discard it)
    tokens, _ = run_generate(srv.stub(), greedy([5, 6, 7], 3), timeout=60)
    assert len(tokens) == 3
    sampled = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2,
                                          max_new_tokens=6, ignore_eos=True, n=2))
    completes = [r.complete for r in srv.stub().Generate(sampled, timeout=60)
                 if r.HasField("complete")]
    assert sorted(len(c.output_ids) for c in completes) == [6, 6]


LEAN = dict(with_stack=False, record_shapes=False)


def test_profiles_are_written_by_every_tp_rank(tp_server) -> None:
    """SGLang's names, {id}-TP-{tp}[-DP-{dp}]; num_steps ends the profile on the same step
    on both TP ranks (each counts rank 0's steps), and StopProfile hands over every file."""
    srv, _, dp, _ = tp_server
    stub = srv.stub()
    dp_part = [f"-DP-{r}" if dp > 1 else "" for r in range(dp)]
    # no Python stacks nor shapes: what is checked here does not depend on them, and
    # tracing every Python call makes each rank's steps and export several times dearer
    start = stub.StartProfile(pb.StartProfileRequest(output_dir="tp", **LEAN), timeout=60)
    assert start.success, start.message
    for rank in range(dp):
        run_generate(stub, greedy([9, 8, 7, rank], 6, data_parallel_rank=rank), timeout=60)
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=120)
    assert stop.success, stop.message
    assert sorted(os.path.basename(f) for f in stop.files) == sorted(
        f"{start.profile_id}-TP-{t}{part}.trace.json.gz" for part in dp_part for t in range(2))
    assert all(os.path.getsize(f) > 0 for f in stop.files)
    assert [len(r.files) for r in stop.rank_results] == [2] * dp
    # num_steps: every TP rank stops by itself after the same 3 steps and writes its trace
    root = Path(srv.extra_args[srv.extra_args.index("--profile-dir") + 1])
    start = stub.StartProfile(pb.StartProfileRequest(output_dir="steps", num_steps=3, **LEAN),
                              timeout=60)
    assert start.success, start.message
    for rank in range(dp):
        run_generate(stub, greedy([9, 8, 6, rank], 6, data_parallel_rank=rank), timeout=60)
    want = {f"{start.profile_id}-TP-{t}{part}.trace.json.gz" for part in dp_part
            for t in range(2)}
    steps = root / "steps"
    wait_for(lambda: steps.is_dir() and want <= set(os.listdir(steps)), 60,
             "every TP rank's trace")
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=120)
    assert not stop.success and "not in progress" in stop.message  # it ended by itself


def checkpoint_tensors(path: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_get_weights_by_name_gathers_the_full_tensor_and_check_weights_is_per_rank(
    tp_server,
) -> None:
    srv, _, dp, path = tp_server
    stub = srv.stub()
    full = checkpoint_tensors(path)
    # split by rows (q, k/v: split on Llama, one replicated KV head on Qwen2; gate/up), by
    # columns (o_proj, down_proj), a row-split bias, the replicated embedding
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
             "model.layers.1.mlp.down_proj.bias", "model.layers.0.input_layernorm.weight"]
    for name in names:
        if name not in full:
            continue  # the other architecture's bias
        want = full[name]
        resp = stub.GetWeightsByName(pb.GetWeightsByNameRequest(
            name=name, truncate_size=want.numel()), timeout=30)
        assert resp.success, (name, resp.message)
        assert list(resp.shape) == list(want.shape), name
        assert torch.equal(torch.tensor(list(resp.values)), want.reshape(-1).float()), name
    unknown = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name="model.nope.weight"),
                                    timeout=30)
    assert not unknown.success and "model.nope.weight" in unknown.message
    check = stub.CheckWeights(pb.CheckWeightsRequest(), timeout=60)
    assert check.success, check.message
    assert [(r.dp_rank, r.tp_rank) for r in check.rank_results] == [
        (d, t) for d in range(dp) for t in range(2)]
    by_tp = [{r.digest for r in check.rank_results if r.tp_rank == t} for t in range(2)]
    assert all(len(d) == 1 for d in by_tp)  # the replicas agree, TP rank by TP rank ...
    assert by_tp[0] != by_tp[1]  # ... and each TP rank holds its own shard
    assert len(check.digest) == 64


TRAINER = [sys.executable, "-m", "tests.integration.sglang_trainer"]
SYNC_TOKENS = 8


def load_base(srv: ServerProc, ckpt: Path) -> None:
    refit = srv.stub().UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(ckpt)), timeout=120)
    assert refit.success, refit.message


def test_lora_at_tp2_equals_peft_token_for_token(sync_worker) -> None:
    """test_lora.py's mixed batch (the base model and two adapters in one batch, logprobs
    within 1e-4 of peft's) with A/B cut as their base layers are."""
    from tests.integration.test_lora import test_mixed_batch_equals_peft_token_for_token as same

    srv, ckpt, adapters = sync_worker
    load_base(srv, ckpt)
    same(("llama-tp2", srv, adapters))


def sync_outputs(srv: ServerProc) -> list[list[int]]:
    return [run_generate(srv.stub(), greedy(p[:12], SYNC_TOKENS), timeout=120)[0]
            for p in PROMPTS]


def check_digests(srv: ServerProc) -> list[str]:
    resp = srv.stub().CheckWeights(pb.CheckWeightsRequest(), timeout=60)
    assert resp.success, resp.message
    return [r.digest for r in resp.rank_results]


def test_a_trainer_pushes_to_every_tp_rank_as_a_refit_from_disk_would(
    sync_worker, tmp_path: Path
) -> None:
    """tests/integration/sglang_trainer.py (world 3: the trainer and the two TP ranks at
    rank_offset 1 and 2, SGLang's convention) pushes three times: SGLang's helper, one
    broadcast per tensor; our WeightPusher, flattened buckets then per tensor; shared
    memory. Each time the worker answers as transformers on the trained model does, and
    after the first push each TP rank holds exactly what a refit from disk of the same
    weights loads (CheckWeights' per-rank digests)."""
    srv, ckpt, _ = sync_worker
    load_base(srv, ckpt)
    stub = srv.stub()
    before = sync_outputs(srv)
    log = tmp_path / "trainer.log"
    with open(log, "w") as err:
        trainer = subprocess.Popen(
            [*TRAINER, "sglang", srv.target, str(ckpt), str(tmp_path), str(free_port()),
             str(free_port())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def expect(line: str) -> None:
        assert trainer.stdout is not None
        while (got := trainer.stdout.readline()) and got.strip() != line:
            pass
        assert got, f"trainer ended before {line!r}:\n{log.read_text()[-4000:]}"

    def next_phase() -> None:
        assert trainer.stdin is not None
        trainer.stdin.write("next\n")
        trainer.stdin.flush()

    try:
        expect("pushed sglang")
        pushed = sync_outputs(srv)
        expected = [reference(hf_model(tmp_path / "sglang"), p[:12], SYNC_TOKENS)[0]
                    for p in PROMPTS]
        assert pushed == expected != before
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).weight_version == \
            "sglang-1"
        digests = check_digests(srv)
        refit = stub.UpdateWeightsFromDisk(
            pb.UpdateWeightsFromDiskRequest(model_path=str(tmp_path / "sglang")), timeout=120)
        assert refit.success, refit.message
        assert check_digests(srv) == digests  # bit for bit, on each TP rank
        assert sync_outputs(srv) == pushed
        next_phase()
        expect("pushed helper")
        assert sync_outputs(srv) == [
            reference(hf_model(tmp_path / "helper"), p[:12], SYNC_TOKENS)[0] for p in PROMPTS]
        next_phase()
        expect("pushed shm")
        assert sync_outputs(srv) == [
            reference(hf_model(tmp_path / "shm"), p[:12], SYNC_TOKENS)[0] for p in PROMPTS]
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).weight_version == \
            "shm-3"
        assert trainer.wait(120) == 0, log.read_text()[-4000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait(60)
    # a manifest of shard shapes (not the full ones a trainer sends) is refused clearly
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeightsFromDistributed(pb.UpdateWeightsFromDistributedRequest(
            names=["model.layers.0.mlp.up_proj.weight"], dtypes=["float32"],
            shapes=[pb.TensorShape(dims=[64, 64])], group_name="helper-group"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the model's is [128, 64]" in err.value.details()


def test_memory_release_and_resume_on_every_tp_rank(sync_worker) -> None:
    """Both TP ranks free their KV pool and their shard; a resume reloads every shard from
    the checkpoint and checks the replica's digest: the same weights, the same tokens."""
    srv, ckpt, _ = sync_worker
    stub = srv.stub()
    load_base(srv, ckpt)
    before, digests = sync_outputs(srv), check_digests(srv)
    released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(), timeout=60)
    assert released.success, released.message
    # both TP ranks' shards and pools: more than the whole model (the embedding is on both)
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoint_tensors(ckpt).values())
    assert released.rank_results[0].bytes_released > model_bytes
    again = stub.ReleaseMemoryOccupation(
        pb.ReleaseMemoryOccupationRequest(tags=["weights"]), timeout=60)
    assert not again.success and "weights" in again.message
    resumed = stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(), timeout=120)
    assert resumed.success, resumed.message
    assert "weights reloaded" in resumed.rank_results[0].message
    assert check_digests(srv) == digests
    assert sync_outputs(srv) == before


def test_update_weights_from_disk_reaches_every_tp_rank(sync_worker, tmp_path: Path) -> None:
    """A refit from disk to other weights of the same shapes: both TP ranks load their shard
    (all prompts at once equal transformers on the new weights); a checkpoint of another
    shape is refused by every rank and the new weights stay."""
    srv, ckpt, _ = sync_worker
    load_base(srv, ckpt)
    assert_equal_to_transformers(srv, hf_model(ckpt), 1)
    second = tmp_path / "second"  # the base's weights, each drawn again
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else None
    model.save_pretrained(second, safe_serialization=True)
    resp = srv.stub().UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(second)), timeout=120)
    assert resp.success, resp.message
    second_model = hf_model(second)
    assert_equal_to_transformers(srv, second_model, 1)
    # a checkpoint of another shape is refused by every rank; the old weights stay
    other = tmp_path / "other"
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    resp = srv.stub().UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(other)), timeout=120)
    assert not resp.success and "intermediate_size" in resp.message, resp.message
    assert_equal_to_transformers(srv, second_model, 1)


def _tp_follower_pids(srv: ServerProc) -> list[int]:
    pids = []
    for pid in srv.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_killed_or_stopped_tp_rank_takes_the_worker_down(tmp_path: Path, sig: int,
                                                            tmp_path_factory) -> None:
    """SIGKILL: the server sees the exit (the default probe timeout); SIGSTOP: the
    follower's heartbeat falls silent (--watchdog-probe-timeout 2) while rank 0 waits for
    it in an all-reduce."""
    path = shared_checkpoint("qwen2", tmp_path_factory)
    # the short probe only where the test needs it: it makes both ranks import their late
    # imports before READY (scheduler/late_imports.py), and an exit needs no probe
    probe = ("--watchdog-probe-timeout", "2") if sig == signal.SIGSTOP else ()
    srv = start_tp(tmp_path, path, 1, *probe)
    try:
        children = srv.children()
        stub = srv.stub()
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        leader = info.rank_states[0].pid
        followers = [p for p in _tp_follower_pids(srv) if p != leader]
        assert len(followers) == 1, children
        statuses: list[int] = []
        watch = health_pb2_grpc.HealthStub(srv.channel()).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60)

        def watcher() -> None:
            try:
                for resp in watch:
                    statuses.append(resp.status)
            except grpc.RpcError:
                pass

        threading.Thread(target=watcher, daemon=True).start()
        result: dict = {}

        def generate() -> None:
            try:
                run_generate(stub, greedy([1, 2, 3], 500), timeout=60)
                result["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                result["code"], result["details"] = exc.code(), exc.details()

        caller = threading.Thread(target=generate, daemon=True)
        caller.start()
        time.sleep(0.5)
        killed = time.time()
        os.kill(followers[0], sig)
        caller.join(max(0.0, killed + 10 - time.time()))
        assert not caller.is_alive(), "the call still hangs 10 s after the TP rank died"
        assert result.get("code") == grpc.StatusCode.UNAVAILABLE, result
        wait_for(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in statuses, 5,
                 "NOT_SERVING")
        assert srv.proc.wait(30) != 0
        assert_gone(children)
        assert "TP rank 1" in srv.log()
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.gpu
def test_tp2_on_two_gpus_equals_transformers(tmp_path: Path) -> None:
    """tools/gpu_check.sh: the same equality over nccl, one GPU per TP rank."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("tp 2 over nccl needs two CUDA devices")
    path = build_checkpoint("llama", tmp_path / "ckpt")
    srv = start_tp(tmp_path, path, 1, "--device", "cuda")
    try:
        assert_equal_to_transformers(srv, hf_model(path), 1)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
