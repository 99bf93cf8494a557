"""The RL refit surface end to end, as a trainer drives it: pause, flush, update the weights
from disk, set the version, continue; bad updates; weight checks; memory release.

Checkpoints A and B are random tiny Qwen2 models saved with transformers; every output is
compared token for token with transformers' greedy generate on A or on B.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.conftest import ServerProc, greedy, run_generate, start_server, wait_started

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 320
NUM_STREAMS = 32
STREAM_TOKENS = 384  # long enough that the streams are still running when the pause lands
CHECK_TOKENS = 10
PARAM = "model.layers.0.mlp.up_proj.weight"


# ---------------------------------------------------------------- checkpoints


def build_qwen2(path: Path, seed: int, *, hidden: int = 64, intermediate: int = 128,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = VOCAB,
                llama: bool = False) -> Path:
    """A random float32 Qwen2 (or, with ``llama``, a Llama of the same shapes) checkpoint."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, eos_token_id=1, bos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True, torch_dtype="float32",
    )
    if llama:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # a larger init than 0.02 keeps greedy outputs varied
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() == 2 else 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@dataclass
class Checkpoints:
    a: Path
    b: Path
    llama: Path
    truncated: Path
    prompts: list[list[int]]
    ref_a: list[list[int]]  # greedy CHECK_TOKENS continuations of each prompt on A
    ref_b: list[list[int]]
    model_a: object  # transformers' models of A and B
    model_b: object


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@dataclass
class CheckpointFiles:
    a: Path
    b: Path
    llama: Path
    truncated: Path
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFiles:
    """The checkpoints on disk and the prompts (what the worker needs to start)."""
    root = tmp_path_factory.mktemp("ckpts")
    a = build_qwen2(root / "A", seed=1)
    b = build_qwen2(root / "B", seed=2)
    llama = build_qwen2(root / "llama", seed=3, llama=True)
    truncated = root / "truncated"
    shutil.copytree(a, truncated)
    weights = truncated / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # the header survives, the tensor data stops half-way
        f.truncate(size // 2)
    rng = random.Random(11)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 24))]
               for _ in range(NUM_STREAMS)]
    return CheckpointFiles(a, b, llama, truncated, prompts)


@pytest.fixture(scope="module")
def ckpts(files: CheckpointFiles) -> Checkpoints:
    """The files with transformers' greedy continuations on A and B (64 generate calls:
    computed while the dp 2 worker boots, see ``dp2``)."""
    a, b, prompts = files.a, files.b, files.prompts
    models = {}
    for key, path in (("A", a), ("B", b)):
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        models[key] = m.eval()
    ref_a = [hf_greedy(models["A"], p, CHECK_TOKENS) for p in prompts]
    ref_b = [hf_greedy(models["B"], p, CHECK_TOKENS) for p in prompts]
    # Otherwise "equals A or B, never a mix" would prove nothing.
    assert sum(x != y for x, y in zip(ref_a, ref_b)) >= NUM_STREAMS * 3 // 4
    return Checkpoints(a, b, files.llama, files.truncated, prompts, ref_a, ref_b, models["A"],
                       models["B"])


@pytest.fixture(scope="module")
def dp2(files: CheckpointFiles, tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest) -> Iterator[ServerProc]:
    srv = start_server(
        tmp_path_factory.mktemp("refit-dp2"), "--model-path", str(files.a), "--dp-size", "2",
        "--dtype", "float32", "--log-requests", wait=False,
    )
    try:
        request.getfixturevalue("ckpts")  # transformers' references while the worker boots
        wait_started(srv)
        yield srv
    finally:
        srv.stop()


# ---------------------------------------------------------------- helpers


class Stream:
    """One streaming Generate run in a thread: tokens, completion, error, first-chunk event."""

    def __init__(self, stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest,
                 timeout: float = 300) -> None:
        self.tokens: list[int] = []
        self.complete: pb.GenerateComplete | None = None
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(stub, req, timeout), daemon=True)
        self.thread.start()

    def _run(self, stub, req, timeout) -> None:
        try:
            for resp in stub.Generate(req, timeout=timeout):
                if resp.HasField("chunk"):
                    self.tokens.extend(resp.chunk.token_ids)
                    if resp.chunk.token_ids:
                        self.started.set()
                else:  # it repeats the last chunk's tokens, as SGLang's servicer does
                    self.complete = resp.complete
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()

    def join(self, timeout: float = 300) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream did not finish"


def start_streams(stub, prompts: list[list[int]], n: int) -> list[Stream]:
    streams = [Stream(stub, greedy(p, n, stream=True)) for p in prompts]
    for s in streams:
        assert s.started.wait(120)
    return streams


def outputs(stub, prompts: list[list[int]], n: int = CHECK_TOKENS) -> list[list[int]]:
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: run_generate(stub, greedy(p, n), timeout=120)[0], prompts))


def server_info(stub) -> pb.GetServerInfoResponse:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def model_info(stub) -> pb.GetModelInfoResponse:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


def update(stub, path: Path | str, version: str = "", **kw) -> pb.UpdateWeightsResponse:
    return stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(path), weight_version=version, **kw),
        timeout=300)


def waiting_requests(stub) -> int:
    return sum(s.num_waiting_reqs for s in server_info(stub).rank_states)


def wait_until(cond, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


@pytest.fixture
def on_a(dp2: ServerProc, ckpts: Checkpoints) -> pb_grpc.SglangSchedulerStub:
    """The dp 2 worker unpaused and serving checkpoint A, version "A"."""
    stub = dp2.stub()
    assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    resp = update(stub, ckpts.a, "A")
    assert resp.success, resp.message
    return stub


# ---------------------------------------------------------------- 1. the refit loop


def test_refit_loop_pause_retract_flush_update_continue(on_a, ckpts: Checkpoints) -> None:
    stub = on_a
    assert outputs(stub, ckpts.prompts[:4]) == ckpts.ref_a[:4]
    streams = start_streams(stub, ckpts.prompts, STREAM_TOKENS)

    paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="retract"), timeout=30)
    assert paused.success, paused.message
    assert [r.dp_rank for r in paused.rank_results] == [0, 1]
    assert paused.num_paused_requests > 0  # the streams were running, now retracted
    assert paused.num_paused_requests == sum(r.num_paused_requests for r in paused.rank_results)
    assert server_info(stub).is_paused

    flushed = stub.FlushCache(pb.FlushCacheRequest(), timeout=60)
    assert flushed.success, flushed.message  # retract freed every request's KV

    updated = update(stub, ckpts.b, "step-1")
    assert updated.success, updated.message
    assert updated.weight_version == "step-1"
    assert updated.model_path == str(ckpts.b)
    assert all(r.success for r in updated.rank_results)
    info = model_info(stub)
    assert info.weight_version == "step-1"
    assert info.model_path == str(ckpts.b)
    assert server_info(stub).is_paused  # an update does not continue generation

    cont = stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30)
    assert cont.success, cont.message
    assert not server_info(stub).is_paused

    for s in streams:
        s.join()
        assert s.error is None, s.error
        assert s.complete is not None and s.complete.finish_reason == "length"
        assert len(s.tokens) == STREAM_TOKENS
    assert outputs(stub, ckpts.prompts) == ckpts.ref_b


# ---------------------------------------------------------------- 2. pause modes


def test_pause_abort_ends_requests_and_holds_new_ones_until_continue(on_a, ckpts: Checkpoints) -> None:
    stub = on_a
    streams = start_streams(stub, ckpts.prompts[:8], STREAM_TOKENS)
    paused = stub.PauseGeneration(pb.PauseGenerationRequest(), timeout=30)  # default: abort
    assert paused.success, paused.message
    for s in streams:
        s.join()
        assert s.error is None, s.error
        assert s.complete is not None and s.complete.finish_reason == "abort"
        assert len(s.tokens) < STREAM_TOKENS
    assert server_info(stub).is_paused

    # A request sent while paused waits (queued, not refused) ...
    with cf.ThreadPoolExecutor(1) as pool:
        held = pool.submit(run_generate, stub, greedy(ckpts.prompts[0], CHECK_TOKENS), timeout=120)
        wait_until(lambda: waiting_requests(stub) >= 1, "the held request never queued")
        # ... and its deadline still holds.
        with pytest.raises(grpc.RpcError) as err:
            run_generate(stub, greedy(ckpts.prompts[1], CHECK_TOKENS), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The worker dropped the expired one; the held one still waits.
        wait_until(lambda: waiting_requests(stub) == 1, "the expired request stayed queued")
        assert not held.done()
        assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
        tokens, complete = held.result(120)
    assert tokens == ckpts.ref_a[0]
    assert complete.finish_reason == "length"
    assert not server_info(stub).is_paused


def test_pause_in_place_blocks_flush_and_resumes_exactly(on_a, ckpts: Checkpoints) -> None:
    stub = on_a
    prompts = ckpts.prompts[:8]
    uninterrupted = outputs(stub, prompts, STREAM_TOKENS)
    assert [t[:CHECK_TOKENS] for t in uninterrupted] == ckpts.ref_a[:8]
    assert stub.FlushCache(pb.FlushCacheRequest(), timeout=60).success  # nothing cached
    streams = start_streams(stub, prompts, STREAM_TOKENS)
    paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=30)
    assert paused.success, paused.message
    assert paused.num_paused_requests > 0
    flushed = stub.FlushCache(pb.FlushCacheRequest(timeout_s=0), timeout=60)
    assert not flushed.success
    assert "pending requests" in flushed.message, flushed.message
    release = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(), timeout=60)
    assert not release.success  # held requests keep their KV: not idle
    assert "only when idle" in release.message, release.message
    assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    for expected, s in zip(uninterrupted, streams):
        s.join()
        assert s.error is None, s.error
        assert s.complete is not None and s.complete.finish_reason == "length"
        assert s.tokens == expected


def test_abort_all_and_weight_version(on_a, ckpts: Checkpoints) -> None:
    stub = on_a

    def held_streams() -> list[Stream]:
        """Streams that cannot finish before the abort: held in place by a pause. On a
        loaded machine a stream can run its tokens out before the pause reaches the rank;
        then it is done again (the pause's own count says whether every stream was held)."""
        for _ in range(4):
            streams = start_streams(stub, ckpts.prompts[:6], STREAM_TOKENS)
            paused = stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"),
                                          timeout=30)
            assert paused.success, paused.message
            if paused.num_paused_requests == len(streams):
                return streams
            assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
            for s in streams:
                s.join()
        pytest.fail("a pause never caught all 6 streams running in 4 tries")

    def all_aborted(streams: list[Stream]) -> None:
        for s in streams:
            s.join()
            assert s.error is None, s.error
            assert s.complete is not None and s.complete.finish_reason == "abort"
            assert len(s.tokens) < STREAM_TOKENS

    streams = held_streams()
    resp = stub.Abort(pb.AbortRequest(abort_all=True), timeout=30)
    assert resp.success, resp.message
    all_aborted(streams)
    assert server_info(stub).is_paused  # abort_all does not continue
    assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    assert outputs(stub, ckpts.prompts[:2]) == ckpts.ref_a[:2]

    streams = held_streams()
    version = stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(new_version="v7"), timeout=30)
    assert version.success, version.message
    all_aborted(streams)  # abort_all_requests defaults to true
    assert stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=30).success
    info = model_info(stub)
    assert (info.weight_version, info.model_path) == ("v7", str(ckpts.a))
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeightVersion(pb.UpdateWeightVersionRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- 3. update while busy


def test_update_on_busy_unpaused_worker_never_mixes_weights(on_a, ckpts: Checkpoints) -> None:
    stub = on_a
    n = CHECK_TOKENS
    before = start_streams(stub, ckpts.prompts[:16], n)  # running when the update arrives
    with cf.ThreadPoolExecutor(17) as pool:
        upd = pool.submit(update, stub, ckpts.b, "busy-B")
        after = [Stream(stub, greedy(p, n, stream=True)) for p in ckpts.prompts[16:]]
        resp = upd.result(300)
    assert resp.success, resp.message
    for i, s in enumerate(before + after):
        s.join()
        assert s.error is None, s.error
        assert s.complete is not None and s.complete.finish_reason == "length"
        assert s.tokens in (ckpts.ref_a[i], ckpts.ref_b[i]), f"request {i} mixed weights"
    # Those running when the update arrived finished on A: the update waited for them.
    assert [s.tokens for s in before] == ckpts.ref_a[:16]
    assert model_info(stub).weight_version == "busy-B"
    assert outputs(stub, ckpts.prompts[:8]) == ckpts.ref_b[:8]


def test_update_aborts_when_asked_and_flushes_the_stale_cache(on_a, ckpts: Checkpoints) -> None:
    stub = on_a
    streams = start_streams(stub, ckpts.prompts[:6], STREAM_TOKENS)
    resp = update(stub, ckpts.b, "B", abort_all_requests=True)
    assert resp.success, resp.message
    assert resp.num_paused_requests > 0
    for s in streams:
        s.join()
        assert s.error is None, s.error
        assert s.complete is not None and s.complete.finish_reason == "abort"

    prompt = list(range(100, 140))  # pinned to rank 0, whose prefix cache it fills

    def on_rank0() -> tuple[list[int], int]:
        tokens, complete = run_generate(stub, greedy(prompt, CHECK_TOKENS, data_parallel_rank=0),
                                        timeout=60)
        return tokens, complete.cached_tokens

    ref = {"A": hf_greedy(ckpts.model_a, prompt, CHECK_TOKENS),
           "B": hf_greedy(ckpts.model_b, prompt, CHECK_TOKENS)}
    assert ref["A"] != ref["B"]
    tokens, _ = on_rank0()
    assert tokens == ref["B"]
    assert on_rank0()[1] > 0  # the prompt is cached now
    assert update(stub, ckpts.a, "A").success  # flush_cache defaults to true
    assert on_rank0() == (ref["A"], 0)  # nothing computed with B's weights is reused
    assert update(stub, ckpts.a, "A", flush_cache=False).success
    assert on_rank0()[1] > 0  # kept, as asked


# ---------------------------------------------------------------- 4. bad updates


@pytest.mark.parametrize("which", ["missing", "llama", "truncated"])
def test_bad_update_fails_clearly_and_keeps_serving_a(on_a, ckpts: Checkpoints, which: str) -> None:
    stub = on_a
    path = {"missing": ckpts.a.parent / "no-such-dir", "llama": ckpts.llama,
            "truncated": ckpts.truncated}[which]
    resp = update(stub, path, "bad")
    assert not resp.success
    named = {"missing": ["no-such-dir", "not a directory"],
             "llama": ["llama"],
             "truncated": ["model.safetensors", "file not fully covered"]}[which]
    for word in named:
        assert word.lower() in resp.message.lower(), resp.message
    assert resp.weight_version == "A"
    assert resp.model_path == str(ckpts.a)
    info = model_info(stub)
    assert (info.weight_version, info.model_path) == ("A", str(ckpts.a))
    assert outputs(stub, ckpts.prompts[:8]) == ckpts.ref_a[:8]


# ---------------------------------------------------------------- 5. weight checks


def test_weights_by_name_and_checksum_follow_the_checkpoint(on_a, ckpts: Checkpoints) -> None:
    stub = on_a

    def served(name: str) -> pb.GetWeightsByNameResponse:
        resp = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name=name, truncate_size=50),
                                     timeout=30)
        assert resp.success, resp.message
        assert [r.dp_rank for r in resp.rank_results] == [0, 1]
        return resp

    def expected(path: Path, name: str) -> torch.Tensor:
        return safetensors_torch.load_file(path / "model.safetensors")[name]

    def digest() -> str:
        resp = stub.CheckWeights(pb.CheckWeightsRequest(action="checksum"), timeout=60)
        assert resp.success, resp.message
        digests = [r.digest for r in resp.rank_results]
        assert len(digests) == 2 and digests[0] == digests[1] == resp.digest
        assert resp.digest
        return resp.digest

    for path in (ckpts.a, ckpts.b):
        if path == ckpts.b:
            assert update(stub, ckpts.b, "B").success
        for name in (PARAM, "model.layers.1.self_attn.k_proj.bias"):
            resp = served(name)
            ref = expected(path, name)
            assert list(resp.shape) == list(ref.shape)
            assert list(resp.values) == ref.reshape(-1)[:50].tolist()
    digest_b = digest()
    assert update(stub, ckpts.a, "A").success
    digest_a = digest()
    assert digest_a != digest_b
    assert update(stub, ckpts.a, "A-again").success
    assert digest() == digest_a  # the digest is a function of the weights alone

    missing = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name="no.such.weight"), timeout=30)
    assert not missing.success and "no.such.weight" in missing.message


# ---------------------------------------------------------------- 6. memory release


def test_resume_never_serves_weights_other_than_those_released(
    on_a, ckpts: Checkpoints, tmp_path: Path
) -> None:
    """A trainer overwrote the checkpoint directory while the weights were released: the
    worker cannot restore what it released, so it says so and refuses Generate until a
    refit, rather than serving other weights under the old version."""
    stub = on_a
    moving = tmp_path / "moving"
    shutil.copytree(ckpts.a, moving)
    assert update(stub, moving, "C").success
    released = stub.ReleaseMemoryOccupation(
        pb.ReleaseMemoryOccupationRequest(tags=["weights"]), timeout=60)
    assert released.success, released.message
    shutil.copy(ckpts.b / "model.safetensors", moving / "model.safetensors")

    resumed = stub.ResumeMemoryOccupation(
        pb.ResumeMemoryOccupationRequest(tags=["weights"]), timeout=60)
    assert not resumed.success
    assert "changed since" in resumed.message, resumed.message
    with pytest.raises(grpc.RpcError) as err:
        run_generate(stub, greedy(ckpts.prompts[0], CHECK_TOKENS), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "UpdateWeightsFromDisk" in err.value.details()

    assert update(stub, ckpts.a, "A").success  # a refit makes it serve again
    assert outputs(stub, ckpts.prompts[:4]) == ckpts.ref_a[:4]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def vm_bytes(pid: int) -> int:
    """The process's mapped (virtual) size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


def rank_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, window: float = 2.0, cpu: float = 0.03, timeout: float = 90) -> None:
    """Until the idle rank spends (almost) no CPU for ``window`` seconds: its late imports
    (torch._dynamo, xgrammar: scheduler/late_imports.py, ~100 MB; a profile's start runs
    them) and the trace's export are done, so they do not grow its RSS while the test
    measures a drop."""
    deadline = time.monotonic() + timeout
    last = rank_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window)
        now = rank_cpu_seconds(pid)
        if now - last < cpu:
            return
        last = now
    raise AssertionError(f"rank {pid} still busy after {timeout} s")


def test_release_memory_lowers_rss_and_resume_serves_the_same(tmp_path: Path) -> None:
    # ~110 MB of float32 weights and ~100 MB of KV pool, so the drop is measurable.
    path = build_qwen2(tmp_path / "big", seed=5, hidden=768, intermediate=2048, layers=2,
                       heads=12, kv_heads=4, vocab=16384)
    kv_tokens = 25600  # 2 layers * (k, v) * 4 kv heads * 64 dims * 4 bytes = 4 KiB a token
    srv = start_server(tmp_path, "--model-path", str(path), "--dtype", "float32",
                       "--max-total-tokens", str(kv_tokens), "--profile-dir", str(tmp_path))
    try:
        stub = srv.stub()
        prompt = [5, 900, 77, 3001, 42, 16000]
        before, _ = run_generate(stub, greedy(prompt, 8), timeout=120)
        pid = server_info(stub).rank_states[0].pid
        # a profile's start has the rank's late imports run now (not DELAY_S after READY,
        # inside the measurement)
        assert stub.StartProfile(pb.StartProfileRequest(
            output_dir="prof", activities=["CPU"], with_stack=False, record_shapes=False),
            timeout=120).success
        assert stub.StopProfile(pb.StopProfileRequest(), timeout=120).success
        wait_quiet(pid)
        rss_before, vm_bytes_before = rss_bytes(pid), vm_bytes(pid)

        released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(), timeout=120)
        assert released.success, released.message
        freed = released.rank_results[0].bytes_released
        weight_bytes = sum(p.numel() * 4 for p in
                           safetensors_torch.load_file(path / "model.safetensors").values())
        assert freed >= weight_bytes + kv_tokens * 4096
        # the weights were resident and go back to the system; the KV pool is a mapping of
        # its own whose pages exist only where written (model/runner_memory.py): its whole
        # size leaves the rank's address space
        drop = rss_before - rss_bytes(pid)
        assert drop >= 0.9 * weight_bytes, (drop, weight_bytes)
        assert vm_bytes_before - vm_bytes(pid) >= kv_tokens * 4096

        with cf.ThreadPoolExecutor(1) as pool:  # Generate while released waits
            held = pool.submit(run_generate, stub, greedy(prompt, 8), timeout=120)
            wait_until(lambda: waiting_requests(stub) >= 1, "the held request never queued")
            assert not held.done()
            resumed = stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(), timeout=120)
            assert resumed.success, resumed.message
            after, complete = held.result(120)
        assert after == before
        assert complete.finish_reason == "length"
    finally:
        srv.stop()
