"""Embedding and classification workers behind the real SMG gateway: ``/v1/embeddings``
answers the vector a direct Embed gives, and ``/v1/classify`` the labels and probabilities
of transformers' softmax over the classifier's logits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc, free_port, start_server, wait_started
from tests.embed_checkpoints import Reference, build
from tests.integration.test_smg_router import http, stop_router, wait_for

TEXTS = ["hello world", "an embedding, routed", "x"]


@dataclass
class Gateway:
    base: str
    embedder: tuple[Path, ServerProc]
    classifier: tuple[Path, ServerProc]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("embed-smg")
    paths = []
    for kind in ("qwen3", "llama-classify"):
        (tmp / kind).mkdir()
        paths.append(build(kind, tmp / kind))
    workers = [start_server(tmp, "--model-path", str(p), "--dtype", "float32", wait=False)
               for p in paths]
    try:
        for w in workers:  # they boot side by side
            wait_started(w)
    except Exception:
        for w in workers:
            w.stop()
        raise
    port = free_port()
    log_path = tmp / "router.log"
    cmd = [sys.executable, "-m", "smg.launch_router",
           "--worker-urls", *[f"grpc://127.0.0.1:{w.port}" for w in workers],
           "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
           "--log-level", "info"]
    with open(log_path, "w") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, "NO_COLOR": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        def both_healthy() -> bool:
            if router.poll() is not None:
                raise RuntimeError(f"router exited:\n{log_path.read_text()[-4000:]}")
            try:
                status, body = http("GET", f"{base}/workers", timeout=5)
            except OSError:
                return False
            return status == 200 and sum(bool(w.get("is_healthy"))
                                         for w in body.get("workers", [])) == 2

        wait_for(both_healthy, 90, "both workers healthy in GET /workers")
        time.sleep(1)  # the tokenizers register right after the workers
        yield Gateway(base, (paths[0], workers[0]), (paths[1], workers[1]))
    finally:
        stop_router(router)
        for w in workers:
            w.stop()


def test_workers_register_as_embedding_models(gateway: Gateway) -> None:
    status, body = http("GET", f"{gateway.base}/workers")
    assert status == 200
    for worker in body["workers"]:
        assert worker["labels"]["is_embedding"] == "true"
        assert worker["labels"]["is_generation"] == "false"
        assert worker["models"][0]["model_type"] == ["embeddings"]


def test_v1_embeddings_equals_a_direct_embed(gateway: Gateway) -> None:
    path, worker = gateway.embedder
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = Reference("qwen3", path)
    for text in TEXTS:
        status, body = http("POST", f"{gateway.base}/v1/embeddings",
                            {"model": str(path), "input": text})
        assert status == 200, body
        routed = body["data"][0]["embedding"]
        ids = tokenizer(text)["input_ids"]
        assert body["usage"]["prompt_tokens"] == len(ids)
        direct = worker.stub().Embed(
            pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids)), timeout=60)
        assert routed == pytest.approx(list(direct.embedding), abs=1e-6)
        assert routed == pytest.approx(reference(ids), abs=1e-5)
    # a list of strings is joined with spaces into one input (one embedding)
    status, body = http("POST", f"{gateway.base}/v1/embeddings",
                        {"model": str(path), "input": ["hello", "world"]})
    assert status == 200, body
    assert body["data"][0]["embedding"] == pytest.approx(
        reference(tokenizer("hello world")["input_ids"]), abs=1e-5)


def test_v1_classify_gives_transformers_softmax(gateway: Gateway) -> None:
    path, _ = gateway.classifier
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32).eval()
    for text in TEXTS:
        status, body = http("POST", f"{gateway.base}/v1/classify",
                            {"model": str(path), "input": text})
        assert status == 200, body
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        probs = torch.softmax(logits, dim=-1).tolist()
        answer = body["data"][0]
        assert answer["num_classes"] == 3
        assert answer["probs"] == pytest.approx(probs, abs=1e-5)
        assert answer["label"] == model.config.id2label[int(logits.argmax())]


def test_generation_routes_are_refused_with_400(gateway: Gateway) -> None:
    path, _ = gateway.embedder
    status, body = http("POST", f"{gateway.base}/generate",
                        {"model": str(path), "input_ids": [1, 2, 3],
                         "sampling_params": {"max_new_tokens": 2}})
    assert 400 <= status < 500, (status, body)
