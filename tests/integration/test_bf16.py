"""``--dtype bfloat16`` on CPU through the served worker, against transformers in bfloat16:
greedy decoding, LoRA adapters, refit from float32 and bfloat16 checkpoints, weights pushed
through shared memory, and the rule ``--dtype auto`` follows on CPU.

Two bfloat16 implementations that sum in different orders round differently, so greedy
outputs cannot all be token-equal: most prompts must be, and where one diverges, the first
diverging token and transformers' own choice must be a near tie in transformers' logits
(within NEAR_TIE). After a divergence the two continue from different prefixes; nothing
after it is compared.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest

from sglang_admin.model.cpu_dtype import cpu_has_native_bf16
from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, greedy, run_generate, start_server
from tests.lora_models import build_adapter, build_base, peft_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

NEW_TOKENS = 16
_rng = random.Random(28)
PROMPTS = [[_rng.randrange(3, 320) for _ in range(_rng.randint(3, 90))] for _ in range(12)]
# A near tie in bfloat16: the logit gap between transformers' token and ours at the first
# divergence, in units of bfloat16's spacing at the step's largest logit (2^-7 relative:
# 0.03 at a logit of 4). Both sides round every matmul and norm to bfloat16, in different
# orders, so their logits differ by a few such steps.
NEAR_TIE_ULPS = 4


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at magnitude ``x`` (8 significant bits)."""
    return 2.0 ** (torch.tensor(abs(x) or 1.0).log2().floor().item() - 7)


def hf_greedy_with_logits(model: Any, prompt: list[int], n: int
                          ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for one prompt and its float32 view of each step's logits."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]


def compare(ours: list[list[int]], model: Any, prompts: list[list[int]], n: int,
            where: str) -> int:
    """How many prompts are token-equal; every divergence must be a near tie."""
    equal = 0
    for prompt, got in zip(prompts, ours):
        ref, logits = hf_greedy_with_logits(model, prompt, n)
        assert len(got) == n, where
        if got == ref:
            equal += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        step = logits[j]
        gap = (step[ref[j]] - step[got[j]]).item()
        ulp = bf16_ulp(step.abs().max().item())
        print(f"{where}: prompt {prompts.index(prompt)} diverges at token {j}, "
              f"gap {gap / ulp:.2f} bfloat16 steps")
        assert gap <= NEAR_TIE_ULPS * ulp, (
            f"{where}: prompt {prompts.index(prompt)} diverges at token {j}: transformers "
            f"{ref[j]} ({step[ref[j]].item():.4f}) against ours {got[j]} "
            f"({step[got[j]].item():.4f}), a gap of {gap / ulp:.1f} bfloat16 steps")
    return equal


def assert_every_token_near_argmax(ours: list[list[int]], model: Any,
                                   prompts: list[list[int]], where: str) -> None:
    """Teacher-forced on our own outputs, each token we chose is the model's argmax or a
    near tie of it, at every position (past a divergence too: both see our context)."""
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:]
        for j, token in enumerate(got):
            step = logits[j].float()
            gap = (step.max() - step[token]).item()
            ulp = bf16_ulp(step.abs().max().item())
            assert gap <= NEAR_TIE_ULPS * ulp, (
                f"{where}: prompt {prompts.index(prompt)} token {j}: ours {token} is "
                f"{gap / ulp:.1f} bfloat16 steps below the argmax {int(step.argmax())}")


def served(stub: Any, prompts: list[list[int]], n: int, lora: str = "") -> list[list[int]]:
    """Greedy outputs of every prompt, all sent at once (one batch, chunked prefill)."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run_generate, stub, greedy(p, n, lora_id=lora), timeout=300)
                   for p in prompts]
        return [f.result()[0] for f in futures]


def hf_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def server_dtype(srv: ServerProc) -> str:
    info = srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return info.server_args["dtype"]


# ---------------------------------------------------------------- greedy


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def bf16_worker(request, tmp_path_factory) -> Iterator[tuple[ServerProc, Path]]:
    root = tmp_path_factory.mktemp(f"bf16-{request.param}")
    base = build_base(request.param, root / "base")  # a float32 checkpoint
    srv = start_server(root, "--model-path", str(base), "--dtype", "bfloat16",
                       "--max-prefill-tokens", "64")
    yield srv, base
    srv.stop()


def test_greedy_bfloat16_matches_transformers_bfloat16(bf16_worker) -> None:
    srv, base = bf16_worker
    assert server_dtype(srv) == "bfloat16"
    ours = served(srv.stub(), PROMPTS, NEW_TOKENS)
    model = hf_model(base)
    equal = compare(ours, model, PROMPTS, NEW_TOKENS, "greedy")
    # most token-equal (which ones depends on how the batch was cut: bfloat16 GEMMs round by
    # batch shape); compare() has already asserted that every other one is a near tie
    assert equal > len(PROMPTS) // 2, f"only {equal}/{len(PROMPTS)} token-equal"
    # one at a time (no batching): the same tokens as in the batch but at near ties
    alone = [run_generate(srv.stub(), greedy(p, NEW_TOKENS), timeout=120)[0] for p in PROMPTS[:4]]
    assert compare(alone, model, PROMPTS[:4], NEW_TOKENS, "alone") >= 3


def test_bfloat16_sampling_and_logprobs_are_float32_sane(bf16_worker) -> None:
    srv, _ = bf16_worker
    stub = srv.stub()
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPTS[0]),
        sampling_params=pb.SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01,
                                          max_new_tokens=12, ignore_eos=True, n=3),
        return_logprob=True, top_logprobs_num=3)
    outs = list(stub.Generate(req, timeout=120))
    completes = [r.complete for r in outs if r.HasField("complete")]
    assert len(completes) == 3
    for c in completes:
        assert len(c.output_ids) == 12
        lps = list(c.output_logprobs.token_logprobs)
        assert len(lps) == 12 and all(-60 < lp <= 0 for lp in lps)


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def bf16_lora(tmp_path_factory) -> Iterator[tuple[ServerProc, dict[str, Path]]]:
    root = tmp_path_factory.mktemp("bf16-lora")
    base = build_base("qwen2", root / "base")
    adapters = {name: build_adapter(base, name, root / name, seed)
                for seed, name in enumerate(["attn", "mlp"], start=1)}
    srv = start_server(root, "--model-path", str(base), "--dtype", "bfloat16",
                       "--max-prefill-tokens", "64", "--max-loaded-loras", "2",
                       "--max-lora-rank", "8", "--lora-paths", f"attn={adapters['attn']}",
                       f"mlp={adapters['mlp']}")
    adapters["base"] = base
    yield srv, adapters
    srv.stop()


def test_lora_in_bfloat16_matches_peft_in_bfloat16(bf16_lora) -> None:
    srv, adapters = bf16_lora
    model = peft_model(adapters["base"], {k: adapters[k] for k in ("attn", "mlp")})
    model = model.to(torch.bfloat16)
    prompts = PROMPTS[:6]
    for lora in ("attn", "mlp"):
        ours = served(srv.stub(), prompts, NEW_TOKENS, lora=lora)
        model.set_adapter(lora)
        # the adapters' extra bfloat16 roundings (peft: x A, then B, then the scaling; ours:
        # the scaling folded into B) make more near ties than the base model alone: seen
        # here, gaps of 0 (an exact tie in peft's logits), 0.5 and 1.5 bfloat16 steps.
        # compare() asserts that the first divergence of each prompt is such a near tie, and
        # every token of ours is then checked against peft on our own context. How many
        # prompts stay token-equal depends on how the CPU rounds bfloat16 GEMMs and how the
        # rank cut its batches (6, 3, 2 and 1 of 6 were seen), so it is printed, not asked.
        equal = compare(ours, model, prompts, NEW_TOKENS, f"adapter {lora}")
        print(f"adapter {lora}: {equal}/{len(prompts)} prompts token-equal to peft")
        assert_every_token_near_argmax(ours, model, prompts, f"adapter {lora}")
    with model.disable_adapter():
        base_out = served(srv.stub(), prompts, NEW_TOKENS)
        assert compare(base_out, model, prompts, NEW_TOKENS, "base") >= len(prompts) // 2
    assert base_out != served(srv.stub(), prompts, NEW_TOKENS, lora="attn")


# ---------------------------------------------------------------- refit and weight sync


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A (float32), B (float32) and B saved in bfloat16 (the same weights, rounded)."""
    root = tmp_path_factory.mktemp("bf16-refit")
    a = build_base("qwen2", root / "A")
    torch.manual_seed(5)
    b = build_base("qwen2", root / "B")
    model = transformers.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    with torch.no_grad():  # B differs from A (build_base seeds the same way)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(b, safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(root / "B16", safe_serialization=True)
    return {"A": a, "B": b, "B16": root / "B16"}


def _refit(stub: Any, path: Path) -> None:
    resp = stub.UpdateWeightsFromDisk(
        pb.UpdateWeightsFromDiskRequest(model_path=str(path), abort_all_requests=True),
        timeout=120)
    assert resp.success, resp.message


def test_refit_in_bfloat16_from_float32_and_bfloat16_checkpoints(checkpoints, tmp_path) -> None:
    srv = start_server(tmp_path, "--model-path", str(checkpoints["A"]), "--dtype", "bfloat16")
    try:
        stub = srv.stub()
        prompts = PROMPTS[:6]
        before = served(stub, prompts, NEW_TOKENS)
        _refit(stub, checkpoints["B"])  # float32 on disk, cast to bfloat16 on load
        from_f32 = served(stub, prompts, NEW_TOKENS)
        assert from_f32 != before
        model_b = hf_model(checkpoints["B"])
        assert compare(from_f32, model_b, prompts, NEW_TOKENS, "refit f32") >= 4
        _refit(stub, checkpoints["A"])
        _refit(stub, checkpoints["B16"])  # bfloat16 on disk: the same weights exactly
        assert served(stub, prompts, NEW_TOKENS) == from_f32
        # pushed through shared memory, in float32 and in bfloat16: the same weights again
        for dtype in (torch.float32, torch.bfloat16):
            _refit(stub, checkpoints["A"])
            _push(stub, checkpoints["B"], dtype)
            assert served(stub, prompts, NEW_TOKENS) == from_f32, dtype
            name = "model.layers.0.mlp.up_proj.weight"
            got = stub.GetWeightsByName(pb.GetWeightsByNameRequest(name=name, truncate_size=8),
                                        timeout=30)
            want = safetensors_torch.load_file(checkpoints["B"] / "model.safetensors")[name]
            assert list(got.values) == want.to(torch.bfloat16).float().flatten()[:8].tolist()
    finally:
        srv.stop()


def _push(stub: Any, path: Path, dtype: torch.dtype) -> None:
    """Every tensor of the checkpoint at ``path``, in ``dtype``, through one shm segment."""
    state = {k: v.to(dtype).contiguous()
             for k, v in safetensors_torch.load_file(path / "model.safetensors").items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        offset = 0
        specs = []
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8)
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            flat[offset : offset + nbytes].copy_(t.flatten().view(torch.uint8))
            specs.append(pb.SharedTensor(name=name, dtype=str(dtype).removeprefix("torch."),
                                         shape=list(t.shape), offset=offset))
            offset += nbytes
        del flat
        resp = stub.UpdateWeightsFromTensor(
            pb.UpdateWeightsFromTensorRequest(shm_name=shm.name, tensors=specs), timeout=120)
        assert resp.success, resp.message
    finally:
        shm.close()
        shm.unlink()


# ---------------------------------------------------------------- --dtype auto


def test_auto_serves_a_bfloat16_checkpoint_in_bfloat16_where_the_cpu_has_it(
        checkpoints, tmp_path, server: ServerProc) -> None:
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    half = start_server(tmp_path, "--model-path", str(checkpoints["B16"]))
    try:
        assert server_dtype(half) == expected
        ours = served(half.stub(), PROMPTS[:4], NEW_TOKENS)
        if expected == "bfloat16":
            assert compare(ours, hf_model(checkpoints["B16"]), PROMPTS[:4], NEW_TOKENS,
                           "auto") >= 2
    finally:
        half.stop()
    # a float32 checkpoint stays float32: the session's worker, the embedded model (its
    # config says float32) started without --dtype
    assert "--dtype" not in server.extra_args
    assert server_dtype(server) == "float32"


# ---------------------------------------------------------------- fuzzing


@pytest.mark.long
def test_brief_fuzz_run_in_bfloat16_finds_no_death(tmp_path, capsys) -> None:
    from tools import fuzz

    srv = start_server(tmp_path, "--dtype", "bfloat16", "--profile-dir",
                       str(tmp_path / "profiles"))  # the embedded model: text, grammars
    try:
        assert server_dtype(srv) == "bfloat16"
        code = fuzz.main(["--target", srv.target, "--requests", "300", "--seconds", "30",
                          "--concurrency", "8", "--seed", "28", "--kinds", ",".join(fuzz.KINDS)])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "server SERVING after the run: yes; rank pids unchanged: yes" in out
        assert "FAIL status" not in out and "DEATH" not in out
        assert "unexpected:" not in out, out
    finally:
        srv.stop()
