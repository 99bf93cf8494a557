"""--tp-size 2 on CPU (gloo): greedy tokens and logprobs equal transformers' through the
server, with 1 and 2 replicas, on Llama (KV heads split, untied LM head) and Qwen2 (one KV
head replicated on both TP ranks, q/k/v biases, tied); the admin ops reach every TP rank;
a dead TP rank takes the worker down."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate, start_server
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
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item()
                for step, tok in zip(out.logits, tokens)]
    return tokens, logprobs


def hf_model(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def start_tp(tmp: Path, path: Path, dp: int = 1, *extra: str) -> ServerProc:
    return start_server(tmp, "--model-path", str(path), "--dtype", "float32",
                        "--max-prefill-tokens", "64", "--tp-size", "2", "--dp-size", str(dp),
                        "--max-total-tokens", "2048", *extra)


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
    for prompt, n, (tokens, complete) in zip(PROMPTS, NEW_TOKENS, results):
        ref_tokens, ref_logprobs = reference(model, prompt, n)
        assert tokens == ref_tokens
        ours = list(complete.output_logprobs.token_logprobs)
        assert len(ours) == n
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4


@pytest.fixture(scope="module", params=[("llama", 1), ("qwen2", 1), ("llama", 2), ("qwen2", 2)],
                ids=lambda p: f"{p[0]}-tp2-dp{p[1]}")
def tp_server(request, tmp_path_factory) -> Iterator[tuple[ServerProc, object, int, Path]]:
    kind, dp = request.param
    path = build_checkpoint(kind, tmp_path_factory.mktemp(kind))
    srv = start_tp(tmp_path_factory.mktemp(f"{kind}-srv"), path, dp)
    yield srv, hf_model(path), dp, path
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


def test_ops_without_tp_support_are_refused(tp_server) -> None:
    srv, _, _, _ = tp_server
    with pytest.raises(grpc.RpcError) as err:
        srv.stub().GetWeightsByName(pb.GetWeightsByNameRequest(name="lm_head.weight"),
                                    timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not yet supported with --tp-size > 1" in err.value.details()
    # a bad request fails alone
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


def test_update_weights_from_disk_reaches_every_tp_rank(tmp_path: Path) -> None:
    first = build_checkpoint("llama", tmp_path / "first", seed=0)
    second = build_checkpoint("llama", tmp_path / "second", seed=1)
    srv = start_tp(tmp_path, first)
    try:
        assert_equal_to_transformers(srv, hf_model(first), 1)
        resp = srv.stub().UpdateWeightsFromDisk(
            pb.UpdateWeightsFromDiskRequest(model_path=str(second)), timeout=120)
        assert resp.success, resp.message
        assert_equal_to_transformers(srv, hf_model(second), 1)
        # a checkpoint of another shape is refused by every rank; the old weights stay
        other = tmp_path / "other"
        torch.manual_seed(2)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
        resp = srv.stub().UpdateWeightsFromDisk(
            pb.UpdateWeightsFromDiskRequest(model_path=str(other)), timeout=120)
        assert not resp.success and "intermediate_size" in resp.message, resp.message
        assert_equal_to_transformers(srv, hf_model(second), 1)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


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


def test_a_killed_tp_rank_takes_the_worker_down(tmp_path: Path) -> None:
    path = build_checkpoint("qwen2", tmp_path / "ckpt")
    srv = start_tp(tmp_path, path)
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
        os.kill(followers[0], signal.SIGKILL)
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
