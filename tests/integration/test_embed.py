"""Embed end to end on tiny embedding and classification checkpoints: the served vectors
equal transformers' (and sentence-transformers') for mixed-length batches sent at once,
the model is reported truthfully, Generate and Embed are refused on the wrong model, bad
input fails alone, and the admin surface (flush, profiles, metrics, health, refits by disk,
tensor and process group, weight reads, memory release) holds for these models."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import Prestart, ServerProc, free_port, greedy, start_server
from tests.embed_checkpoints import KINDS, Reference, build, server_flags

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# float32 against sentence-transformers: a served vector may be computed by other GEMM
# kernels than the reference's (oneDNN picks them by row count and threads); 3.4e-5 was seen
# once beside another test process. A wrong pooling or normalisation is off by far more.
TOLERANCE = 1e-4
# mixed lengths, one longer than --max-prefill-tokens (prefilled in chunks), a repeat of a
# prefix of another (a radix cache hit) and a one-token input
PROMPTS = [[3, 14, 15, 92, 65, 35], [27], list(range(40, 190)), [7] * 17, [5, 6],
           [3, 14, 15, 92, 65, 35, 8, 9], list(range(100, 160)), [255, 1, 2, 3]]


def fresh(root: Path, name: str) -> Path:
    """A new empty directory ``root/name``."""
    (root / name).mkdir()
    return root / name


def embed_request(ids: list[int], **kw) -> pb.EmbedRequest:
    return pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids), **kw)


def embed_all(srv: ServerProc, prompts: list[list[int]]) -> list[pb.EmbedResponse]:
    """Every prompt's Embed, sent at once from as many threads (batched by the rank)."""
    stub = srv.stub()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: stub.Embed(embed_request(ids), timeout=120), prompts))


def assert_close(served: list[float], expected: list[float], what: str) -> None:
    assert len(served) == len(expected), what
    diff = max(abs(a - b) for a, b in zip(served, expected))
    assert diff <= TOLERANCE, f"{what}: max difference {diff:.2e}"


# kinds whose worker the tests of one model below share (qwen3: the admin surface; the
# reward model: its refits): started with their flags, kept to the module's end
SHARED_FLAGS: dict[str, list[str]] = {
    "qwen3": ["--context-length", "256", "--enable-metrics", "--log-requests"],
    "qwen2-reward": [],
}
# the kinds in the order their workers start: the shared ones last, next to their tests
ORDER = [kind for kind in KINDS if kind not in SHARED_FLAGS] + list(SHARED_FLAGS)


@functools.cache
def reference_of(kind: str, path: Path) -> Reference:
    """transformers' model of one checkpoint, loaded once."""
    return Reference(kind, path)


@pytest.fixture(scope="module")
def kinds_ahead(tmp_path_factory) -> tuple[Prestart, dict[str, Path]]:
    """Each kind's checkpoint and worker, the next kind's started while one's tests run."""
    paths: dict[str, Path] = {}

    def start(kind: str) -> ServerProc:
        paths[kind] = build(kind, tmp_path_factory.mktemp(kind))
        extra = list(SHARED_FLAGS.get(kind, []))
        if kind == "qwen3":
            extra += ["--metrics-port", str(free_port()), "--profile-dir",
                      str(tmp_path_factory.mktemp("qwen3-profiles"))]
        # the reward model prefills in chunks of 32 tokens (its refits under load)
        prefill = "32" if kind == "qwen2-reward" else "64"
        return start_server(tmp_path_factory.mktemp(f"{kind}-srv"), "--model-path",
                            str(paths[kind]), "--dtype", "float32", "--max-prefill-tokens",
                            prefill, *server_flags(kind), *extra, wait=False)

    return Prestart(ORDER, start), paths


@pytest.fixture(scope="module")
def kept() -> Iterator[dict[str, ServerProc]]:
    """The workers of SHARED_FLAGS' kinds once taken, stopped at the module's end."""
    workers: dict[str, ServerProc] = {}
    yield workers
    for srv in workers.values():
        srv.stop()


def take(kinds_ahead, kept: dict[str, ServerProc], kind: str) -> ServerProc:
    """``kind``'s worker: the one kept, or the Prestart's (kept when SHARED_FLAGS has it)."""
    if kind not in kept:
        srv = kinds_ahead[0].take(kind)
        if kind not in SHARED_FLAGS:
            return srv
        kept[kind] = srv
    return kept[kind]


@pytest.fixture(scope="module", params=ORDER)
def served(request, kinds_ahead, kept) -> Iterator[tuple[str, Path, ServerProc]]:
    kind = request.param
    srv = take(kinds_ahead, kept, kind)
    yield kind, kinds_ahead[1][kind], srv
    if kind not in SHARED_FLAGS:
        srv.stop()


def test_vectors_equal_transformers_for_a_mixed_batch(served) -> None:
    kind, path, srv = served
    reference = reference_of(kind, path)
    for ids, out in zip(PROMPTS, embed_all(srv, PROMPTS)):
        expected = reference(ids)
        assert out.embedding_dim == len(expected) == len(out.embedding)
        assert out.prompt_tokens == len(ids)
        assert_close(list(out.embedding), expected, f"{kind}, {len(ids)} tokens")
    # again, now from the prefix cache (warm): the same vectors
    again = embed_all(srv, PROMPTS[:3])
    for ids, out in zip(PROMPTS[:3], again):
        assert_close(list(out.embedding), reference(ids), f"{kind} cached, {len(ids)} tokens")
    if KINDS[kind][2] is not None:  # it declares its pooling (modules.json)
        assert_sentence_transformers_agrees(kind, path, srv)


def assert_sentence_transformers_agrees(kind: str, path: Path, srv: ServerProc) -> None:
    """sentence-transformers loads a checkpoint that declares its pooling (modules.json):
    its vectors for the text equal the served ones for the same tokens."""
    st = pytest.importorskip("sentence_transformers")
    texts = ["hello world", "a", "an embedding of a longer sentence, prefilled at once"]
    model = st.SentenceTransformer(str(path), device="cpu")
    expected = model.encode(texts, convert_to_tensor=True).tolist()
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
    for text, out, vec in zip(texts, embed_all(srv, ids), expected):
        assert_close(list(out.embedding), vec, f"sentence-transformers, {kind}: {text!r}")


def test_model_is_reported_as_an_embedding_model(served) -> None:
    kind, _, srv = served
    stub = srv.stub()
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert not info.is_generation
    assert list(info.architectures) == [KINDS[kind][0]]
    num_labels = KINDS[kind][4]
    assert info.num_labels == num_labels
    if num_labels:
        labels = json.loads(info.id2label_json)
        assert len(labels) == num_labels and set(labels) == {str(i) for i in range(num_labels)}
    server_info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert server_info.server_args["is_embedding"] is True


def test_generate_is_refused_naming_the_flag(served) -> None:
    _, _, srv = served
    with pytest.raises(grpc.RpcError) as err:
        list(srv.stub().Generate(greedy([1, 2, 3], 4), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--is-embedding" in err.value.details()


def test_embed_on_a_generation_model_is_refused_naming_the_flag(server: ServerProc) -> None:
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_request([1, 2, 3]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--is-embedding" in err.value.details()
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).is_generation
    args = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).server_args
    assert args["is_embedding"] is False


# ---------------------------------------------------------------- one embedding model


@pytest.fixture(scope="module")
def qwen3(kinds_ahead, kept) -> tuple[Path, ServerProc]:
    """Qwen3Model (LAST pooling, normalized) with metrics, requests logged, context 256:
    the qwen3 kind's worker."""
    srv = take(kinds_ahead, kept, "qwen3")
    return kinds_ahead[1]["qwen3"], srv


@pytest.mark.parametrize("ids, words", [
    ([], "must not be empty"),
    ([5, 261, 7], "outside the vocabulary"),
    ([5, 2**32 - 1], "outside the vocabulary"),
    (list(range(257)), "exceeds the context length"),
])
def test_bad_input_fails_alone_and_the_worker_keeps_serving(qwen3, ids, words) -> None:
    path, srv = qwen3
    stub = srv.stub()
    good = [[3, 4, 5], list(range(10, 60))]
    with cf.ThreadPoolExecutor(3) as pool:
        ok = [pool.submit(stub.Embed, embed_request(p), timeout=60) for p in good]
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(embed_request(ids), timeout=60)
        answers = [f.result() for f in ok]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    reference = reference_of("qwen3", path)
    for p, out in zip(good, answers):
        assert_close(list(out.embedding), reference(p), "beside a bad request")


def test_deadline_and_duplicate_request_id(qwen3) -> None:
    _, srv = qwen3
    stub = srv.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_request(list(range(200))), timeout=0.001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    out = stub.Embed(embed_request([1, 2, 3], request_id="embed-fixed-id"), timeout=60)
    assert out.embedding_dim == 64  # the id is free again once the call ended
    again = stub.Embed(embed_request([1, 2, 3], request_id="embed-fixed-id"), timeout=60)
    assert_close(list(again.embedding), list(out.embedding), "the same id again")


def test_trace_context_reaches_the_rank(qwen3) -> None:
    _, srv = qwen3
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    srv.stub().Embed(embed_request([7, 8, 9], request_id="embed-traced"), timeout=60,
                     metadata=[("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")])
    log = srv.log()
    wait = time.time() + 10
    while "finished rid=embed-traced" not in log and time.time() < wait:
        time.sleep(0.2)
        log = srv.log()
    lines = [line for line in log.splitlines() if "rid=embed-traced" in line]
    # the server's line, the rank's arrival and its finish, each with the caller's trace id
    assert any("[server]" in line and "embed rid=" in line for line in lines), lines
    assert any("[rank0]" in line and "embed rid=" in line for line in lines), lines
    assert any("finished rid=" in line and "reason=length" in line for line in lines), lines
    assert all(f"trace_id={trace_id}" in line for line in lines), lines


def test_metrics_health_flush_and_profile(qwen3) -> None:
    _, srv = qwen3
    stub = srv.stub()
    embed_all(srv, PROMPTS[:4])
    text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=30).text
    requests = [line for line in text.splitlines()
                if line.startswith("sglang:num_requests_total")]
    assert requests and float(requests[0].split()[-1]) >= 4, requests
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    flush = stub.FlushCache(pb.FlushCacheRequest(), timeout=60)
    assert flush.success, flush.message
    profiles = Path(srv.extra_args[srv.extra_args.index("--profile-dir") + 1])
    start = stub.StartProfile(pb.StartProfileRequest(with_stack=False, record_shapes=False),
                              timeout=60)  # a trace is what it checks
    assert start.success, start.message
    embed_all(srv, PROMPTS[:2])
    stop = stub.StopProfile(pb.StopProfileRequest(), timeout=120)
    assert stop.success, stop.message
    assert any(profiles.rglob("*.json*")), list(profiles.rglob("*"))


def test_refit_weight_reads_and_memory_release(qwen3, tmp_path: Path) -> None:
    path, srv = qwen3
    stub = srv.stub()
    other = build("qwen3", fresh(tmp_path, "b"), seed=1)
    ref_a, ref_b = reference_of("qwen3", path), reference_of("qwen3", other)
    prompt = [9, 8, 7, 6, 5]
    name = "layers.0.mlp.up_proj.weight"  # as the checkpoint names it (no "model." prefix)

    def weight() -> list[float]:
        resp = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name=name, truncate_size=5),
                                     timeout=30)
        assert resp.success, resp.message
        return list(resp.values)

    def vector() -> list[float]:
        return list(stub.Embed(embed_request(prompt), timeout=60).embedding)

    digest_a = stub.CheckWeights(pb.CheckWeightsRequest(action="checksum"), timeout=60).digest
    resp = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(other), weight_version="b"), timeout=120)
    assert resp.success, resp.message
    assert_close(vector(), ref_b(prompt), "after the refit to B")
    expected = ref_b.model.state_dict()[name].reshape(-1)[:5].tolist()
    assert weight() == pytest.approx(expected)
    assert stub.CheckWeights(pb.CheckWeightsRequest(action="checksum"),
                             timeout=60).digest != digest_a
    released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(), timeout=60)
    assert released.success, released.message
    resumed = stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(), timeout=120)
    assert resumed.success, resumed.message
    assert_close(vector(), ref_b(prompt), "after release and resume")
    back = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(path), weight_version="a"), timeout=120)
    assert back.success, back.message
    assert_close(vector(), ref_a(prompt), "back on A")
    assert stub.CheckWeights(pb.CheckWeightsRequest(action="checksum"),
                             timeout=60).digest == digest_a


def test_client_and_cli(qwen3) -> None:
    import subprocess
    import sys

    from sglang_admin.client import Client
    from tests.conftest import ROOT

    path, srv = qwen3
    expected = reference_of("qwen3", path)([1, 2, 3, 4])
    with Client(srv.target, timeout=60) as client:
        out = client.embed([1, 2, 3, 4])
    assert_close(list(out.embedding), expected, "Client.embed")
    run = subprocess.run(
        [sys.executable, "-m", "sglang_admin", "embed", "--target", srv.target,
         "--input-ids", "1,2,3,4", "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout.splitlines()[0])
    assert answer["embedding_dim"] == 64 and answer["prompt_tokens"] == 4, answer
    assert_close(answer["embedding"], expected, "sglang-admin embed")


def test_fuzz_run_on_an_embedding_model(qwen3, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import fuzz

    _, srv = qwen3
    kinds = "embed-ordinary,embed-invalid,malformed,admin,generate-ordinary,cancelled"
    code = fuzz.main(["--target", srv.target, "--requests", "200", "--seconds", "30",
                      "--concurrency", "8", "--seed", "3", "--kinds", kinds])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| embed-ordinary |" in out and "| embed-invalid |" in out
    assert "server SERVING after the run: yes; rank pids unchanged: yes" in out
    assert "unexpected:" not in out, out  # embeds OK or INVALID_ARGUMENT, Generate refused


def test_grpcurl_example_of_the_docs(qwen3) -> None:
    """docs/embed.md's grpcurl call (reflection, JSON) answers the vector Embed gives."""
    import subprocess

    from tests.integration.test_grpcurl import GRPCURL

    if GRPCURL is None:
        pytest.skip("grpcurl binary not found")
    path, srv = qwen3
    body = json.dumps({"tokenized": {"input_ids": [9, 70, 11, 87, 0]}})
    out = subprocess.run(
        [str(GRPCURL), "-plaintext", "-max-time", "60", "-d", body, srv.target,
         "sglang.grpc.scheduler.SglangScheduler/Embed"],
        capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["embedding_dim"] == 64 and answer["prompt_tokens"] == 5
    assert_close(answer["embedding"], reference_of("qwen3", path)([9, 70, 11, 87, 0]), "grpcurl")


# ---------------------------------------------------------------- a reward model, refit


@pytest.fixture(scope="module")
def reward(kinds_ahead, kept, tmp_path_factory) -> tuple[dict[str, Path], ServerProc]:
    """A reward model (Qwen2ForSequenceClassification, one label) served from checkpoint A
    (the qwen2-reward kind's worker), with B and C (other seeds) beside it to refit to;
    prefill in chunks of 32 tokens."""
    srv = take(kinds_ahead, kept, "qwen2-reward")
    root = tmp_path_factory.mktemp("reward")
    paths = {"a": kinds_ahead[1]["qwen2-reward"]}
    paths.update({name: build("qwen2-reward", fresh(root, name), seed=seed)
                  for seed, name in enumerate("bc", start=1)})
    return paths, srv


def serve_a(paths: dict[str, Path], srv: ServerProc) -> None:
    """Back on checkpoint A, whatever the test before left (tests share the worker)."""
    resp = srv.stub().UpdateWeightsFromDisk(pb.UpdateWeightsFromDiskRequest(
        model_path=str(paths["a"]), weight_version="a"), timeout=300)
    assert resp.success, resp.message


def test_reward_model_refit_from_tensor_and_process_group(reward) -> None:
    """A reward model (one label) refit by a trainer's tensors: shared memory
    (UpdateWeightsFromTensor) and a gloo process group (UpdateWeightsFromDistributed)."""
    from sglang_admin.client.trainer import WeightPusher

    paths, srv = reward
    serve_a(paths, srv)
    stub = srv.stub()
    prompt = [4, 40, 44, 4]
    pusher = WeightPusher([srv.target], timeout_s=120)
    ref_b, ref_c = reference_of("qwen2-reward", paths["b"]), reference_of("qwen2-reward", paths["c"])
    pusher.push_shared(ref_b.model.named_parameters(), weight_version="b")
    out = stub.Embed(embed_request(prompt), timeout=60)
    assert_close(list(out.embedding), ref_b(prompt), "after UpdateWeightsFromTensor")
    pusher.join("127.0.0.1", free_port())
    try:
        pusher.push(ref_c.model.named_parameters(), weight_version="c")
    finally:
        pusher.destroy()
    out = stub.Embed(embed_request(prompt), timeout=60)
    assert_close(list(out.embedding), ref_c(prompt), "after UpdateWeightsFromDistributed")
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.weight_version == "c" and info.num_labels == 1


def test_reward_model_refit_under_load_never_mixes_weights(reward) -> None:
    """Scores requested without pause while UpdateWeightsFromDisk swaps reward model A for B
    (and back): every score is A's or B's, never a mix; those after each update are the new
    model's."""
    import threading

    paths, srv = reward
    a, b = paths["a"], paths["b"]
    serve_a(paths, srv)
    prompts = [list(range(i, i + 3 + 7 * (i % 6))) for i in range(1, 25)]
    ref = {name: [reference_of("qwen2-reward", p)(ids) for ids in prompts]
           for name, p in (("a", a), ("b", b))}
    stub = srv.stub()
    stop = threading.Event()
    seen: list[tuple[int, list[float]]] = []
    errors: list[BaseException] = []

    def load(worker: int) -> None:
        k = worker
        while not stop.is_set():
            i = k % len(prompts)
            try:
                out = stub.Embed(embed_request(prompts[i]), timeout=120)
            except grpc.RpcError as exc:  # noqa: PERF203
                errors.append(exc)
                return
            seen.append((i, list(out.embedding)))
            k += 5

    threads = [threading.Thread(target=load, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    try:
        for name, path in (("b", b), ("a", a), ("b", b)):
            time.sleep(1.0)
            resp = stub.UpdateWeightsFromDisk(pb.UpdateWeightsFromDiskRequest(
                model_path=str(path), weight_version=name), timeout=300)
            assert resp.success, resp.message
            after = embed_all(srv, prompts[:6])
            for i, out in enumerate(after):
                assert_close(list(out.embedding), ref[name][i], f"after refit to {name}")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(seen) > 20
    for i, score in seen:
        near = [name for name in ("a", "b")
                if max(abs(x - y) for x, y in zip(score, ref[name][i])) <= TOLERANCE]
        assert near, f"prompt {i}: score {score} is neither A's {ref['a'][i]} nor B's " \
                     f"{ref['b'][i]}"
