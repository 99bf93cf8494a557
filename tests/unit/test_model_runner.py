"""ModelRunner against transformers: same greedy tokens, same logprobs, batching-invariant.

Tiny random checkpoints of every supported architecture are written with transformers in
float32; a small scheduler simulation drives the runner (batched prefill, chunked prefill,
decode mixed with prefill, a prefix shared between two requests) and the tokens must equal
``generate(do_sample=False)`` token for token.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.default_model import ensure_default_model  # noqa: E402
from sglang_admin.model.loader import (  # noqa: E402
    WeightMismatch,
    iter_checkpoint,
    load_weights,
)
from sglang_admin.model.runner import (  # noqa: E402
    InvalidSequence,
    ModelRunner,
    SeqInput,
    SeqOutput,
)

MAX_NEW = 10
SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)


def _build(kind: str, path: str, seed: int = 1234) -> None:
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SMALL)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied_llama3":
        cfg = transformers.LlamaConfig(
            **SMALL,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**SMALL)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**SMALL, head_dim=24)
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif kind == "qwen3_yarn":
        cfg = transformers.Qwen3Config(
            **SMALL, head_dim=16,
            rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 32},
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "mistral_swa_linear":
        cfg = transformers.MistralConfig(
            **SMALL, sliding_window=7,
            rope_scaling={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)


KINDS = ["llama", "llama_tied_llama3", "qwen2", "qwen3", "qwen3_yarn", "mistral_swa_linear"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for kind in KINDS:
        path = str(root / kind)
        _build(kind, path)
        dirs[kind] = path
    dirs["default"] = ensure_default_model(str(root / "cache"))
    return dirs


_HF_CACHE: dict[str, Any] = {}


def hf_model(path: str) -> Any:
    if path not in _HF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # the runner test driver never stops early
        model.generation_config.pad_token_id = 0
        _HF_CACHE[path] = model.eval()
    return _HF_CACHE[path]


def hf_greedy(path: str, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax of its raw logits at each step."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack(out.logits).squeeze(1).float().log_softmax(-1)
    assert len(tokens) == max_new
    return tokens, logprobs


# ---------------------------------------------------------------- scheduler simulation


@dataclass
class Req:
    """One simulated request."""

    prompt: list[int]
    arrive: int = 0  # step at which it is admitted
    chunk: int = 0  # prefill chunk size (0: whole prompt at once)
    share_from: int | None = None  # reuse the first share_len slots of that request
    share_len: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # state
    row: int = -1
    slots: list[int] = field(default_factory=list)
    done: int = 0  # tokens whose K/V are in the pool
    out: list[int] = field(default_factory=list)
    outputs: list[SeqOutput] = field(default_factory=list)


def simulate(runner: ModelRunner, reqs: list[Req], max_new: int = MAX_NEW) -> list[Req]:
    """Drive the runner like a scheduler until every request has max_new tokens."""
    free_slots = list(range(1, runner.token_capacity + 1))
    free_rows = list(range(runner.max_running_requests))
    step = 0
    while any(len(r.out) < max_new for r in reqs):
        batch: list[tuple[Req, SeqInput]] = []
        for r in reqs:
            if r.arrive > step or len(r.out) >= max_new:
                continue
            if r.row < 0:
                r.row = free_rows.pop(0)
                if r.share_from is not None:
                    src = reqs[r.share_from]
                    assert src.done >= r.share_len
                    r.slots = src.slots[: r.share_len]
                    r.done = r.share_len
            if r.done < len(r.prompt):
                n = len(r.prompt) - r.done
                if r.chunk:
                    n = min(n, r.chunk)
                new = [free_slots.pop(0) for _ in range(n)]
                table_start = 0 if r.done == r.share_len and r.share_from is not None else r.done
                r.slots = r.slots + new
                seq = SeqInput(
                    req_idx=r.row, prefix_len=r.done, token_ids=r.prompt[r.done : r.done + n],
                    table_start=table_start, table_slots=r.slots[table_start:],
                    sampling=r.params, prompt_ids=r.prompt, output_ids=r.out,
                    sample=r.done + n == len(r.prompt), return_logprob=r.return_logprob,
                    top_logprobs_num=r.top_logprobs_num,
                )
                r.done += n
            else:
                slot = free_slots.pop(0)
                r.slots.append(slot)
                seq = SeqInput(
                    req_idx=r.row, prefix_len=r.done, token_ids=[r.out[-1]],
                    table_start=r.done, table_slots=[slot], sampling=r.params,
                    prompt_ids=r.prompt, output_ids=r.out, return_logprob=r.return_logprob,
                    top_logprobs_num=r.top_logprobs_num,
                )
                r.done += 1
            batch.append((r, seq))
        results = runner.forward_step([seq for _, seq in batch]) if batch else []
        for (r, seq), res in zip(batch, results):
            if seq.sample:
                assert res is not None
                r.out.append(res.token_id)
                r.outputs.append(res)
            else:
                assert res is None
        step += 1
    return reqs


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [3, 17, 30, 9, 1]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def mixed_workload(vocab: int) -> list[Req]:
    """Batched prefill, a chunked prefill, late arrivals mixed with decodes, a shared prefix."""
    p = _prompts(vocab)
    return [
        Req(p[0]),
        Req(p[1]),
        Req(p[2], chunk=8),  # 4 chunks, batched with the others' decodes
        Req(p[3], arrive=2),
        Req(p[1][:12] + p[3][:5], arrive=3, share_from=1, share_len=12),
        Req(p[4], arrive=1),
    ]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request: pytest.FixtureRequest) -> Any:
    """1: a rank's lane on a small machine (prefill chunks through the C kernel where it
    builds); 2: torch's attention for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _runner(path: str, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=1024,
                       max_running_requests=8, **kwargs)


@pytest.mark.parametrize("kind", KINDS + ["default"])
def test_greedy_matches_transformers(model_dirs: dict[str, str], kind: str,
                                     torch_threads: int) -> None:
    path = model_dirs[kind]
    runner = _runner(path)
    reqs = simulate(runner, mixed_workload(runner.info.vocab_size))
    for r in reqs:
        expected, _ = hf_greedy(path, r.prompt, MAX_NEW)
        assert r.out == expected, f"{kind}: prompt of {len(r.prompt)} tokens"


def test_logprobs_match_transformers(model_dirs: dict[str, str], torch_threads: int) -> None:
    path = model_dirs["qwen2"]
    runner = _runner(path)
    reqs = mixed_workload(runner.info.vocab_size)
    for r in reqs:
        r.return_logprob = True
        r.top_logprobs_num = 5
    simulate(runner, reqs)
    for r in reqs:
        tokens, logprobs = hf_greedy(path, r.prompt, MAX_NEW)
        assert r.out == tokens
        for i, res in enumerate(r.outputs):
            assert res.logprob == pytest.approx(logprobs[i, tokens[i]].item(), abs=1e-4)
            assert res.top_logprobs is not None and len(res.top_logprobs) == 5
            top_vals, top_ids = logprobs[i].topk(5)
            assert [t for t, _ in res.top_logprobs] == top_ids.tolist()
            for (_, got), want in zip(res.top_logprobs, top_vals.tolist()):
                assert got == pytest.approx(want, abs=1e-4)


def test_batching_changes_nothing(model_dirs: dict[str, str]) -> None:
    path = model_dirs["llama"]
    runner = _runner(path)
    batched = mixed_workload(runner.info.vocab_size)
    for r in batched:
        r.return_logprob = True
    simulate(runner, batched)
    for r in mixed_workload(runner.info.vocab_size):
        r.arrive, r.share_from, r.share_len, r.chunk = 0, None, 0, 0
        r.return_logprob = True
        runner.reset()
        (solo,) = simulate(runner, [r])
        match = next(b for b in batched if b.prompt == solo.prompt)
        assert solo.out == match.out
        for a, b in zip(solo.outputs, match.outputs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_lanes_change_nothing(model_dirs: dict[str, str], kind: str, torch_threads: int) -> None:
    """A step cut into lanes (threads computing parts of the batch) gives the tokens and
    logprobs of the same step on one lane, prefill chunks, shared prefixes and windows too."""
    path = model_dirs[kind]
    results = []
    for lanes in (1, 3):
        runner = _runner(path, lanes=lanes)
        reqs = mixed_workload(runner.info.vocab_size)
        for r in reqs:
            r.return_logprob = True
        results.append(simulate(runner, reqs))
    for one, laned in zip(*results):
        assert laned.out == one.out
        for a, b in zip(one.outputs, laned.outputs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_large_model_decode_steps_cut_each_matmul_among_lanes_the_same(
        model_dirs: dict[str, str], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At real shapes a decode step's projections and the LM head are cut into one part of
    the weight rows per lane thread (model/lanes.py's thresholds, lowered here to the test
    model): the same tokens and logprobs as one lane."""
    from sglang_admin.model import runner as runner_module
    from sglang_admin.model import runner_lanes

    path = model_dirs[kind]
    assert not _runner(path, lanes=2).split_matmuls  # the test model is far below the bar
    monkeypatch.setattr(runner_module, "packing_available", lambda: False)  # a torch without
    results = []
    for lanes in (1, 2):
        if lanes == 2:
            monkeypatch.setattr(runner_module, "SPLIT_MATMUL_PARAMS", 0)
            monkeypatch.setattr(runner_lanes, "LM_HEAD_SPLIT_PARAMS", 0)
        runner = _runner(path, lanes=lanes)
        assert runner.split_matmuls == (lanes == 2)
        reqs = mixed_workload(runner.info.vocab_size)
        for r in reqs:
            r.return_logprob = True
        results.append(simulate(runner, reqs))
    for one, laned in zip(*results):
        assert laned.out == one.out
        for a, b in zip(one.outputs, laned.outputs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-5)


@pytest.fixture
def packed_runner(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ModelRunner factory for which the test models count as large: projections and LM
    head through oneDNN on packed weights (model/packed_linear.py); torch's thread count put
    back after (a large model's lanes become threads)."""
    from sglang_admin.model import runner as runner_module
    from sglang_admin.model.packed_linear import packing_available

    if not packing_available():
        pytest.skip("this torch build does not pack linear weights (no oneDNN)")
    def make(path: str, **kwargs: Any) -> ModelRunner:
        with monkeypatch.context() as patch:
            patch.setattr(runner_module, "SPLIT_MATMUL_PARAMS", 0)
            return _runner(path, **kwargs)

    threads = torch.get_num_threads()
    yield make
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied_llama3"])
@pytest.mark.parametrize("lanes, as_threads", [(1, True), (2, False), (2, True)],
                         ids=["one-lane", "rows-cut-among-lanes", "lanes-as-threads"])
def test_packed_projections_match_transformers(model_dirs: dict[str, str], kind: str,
                                               lanes: int, as_threads: bool,
                                               packed_runner: Any) -> None:
    """A large model on CPU runs every projection and the LM head on packed weights, whole
    or cut into one part of the rows per lane: transformers' greedy tokens, and the
    logprobs of the unpacked path within float32 rounding."""
    path = model_dirs[kind]
    plain = _runner(path)
    assert plain.packed is None
    reqs = mixed_workload(plain.info.vocab_size)
    for r in reqs:
        r.return_logprob = True
    want = simulate(plain, reqs)
    runner = packed_runner(path, lanes=lanes, lanes_as_threads=as_threads)
    assert runner.packed is not None and not runner.split_matmuls
    assert runner.lanes == (1 if as_threads else lanes)
    reqs = mixed_workload(runner.info.vocab_size)
    for r in reqs:
        r.return_logprob = True
    got = simulate(runner, reqs)
    assert runner.packed.nbytes > 0  # the weights were packed, and used
    for a, b in zip(want, got):
        assert b.out == a.out == hf_greedy(path, a.prompt, MAX_NEW)[0]
        for x, y in zip(a.outputs, b.outputs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_packed_weights_follow_every_weight_update(model_dirs: dict[str, str], tmp_path: Any,
                                                   packed_runner: Any) -> None:
    """Packed copies are made again when the weights change: a refit copied in place
    (load_weights), and a release then resume of the weights (ReleaseMemoryOccupation),
    which also drops the packed copies."""
    other = str(tmp_path / "qwen2-b")
    _build("qwen2", other, seed=99)
    path = model_dirs["qwen2"]
    runner = packed_runner(path, lanes=2, lanes_as_threads=False)
    first = simulate(runner, mixed_workload(runner.info.vocab_size))
    assert [r.out for r in first] == [hf_greedy(path, r.prompt, MAX_NEW)[0] for r in first]
    load_weights(runner.model, iter_checkpoint(other))
    runner.reset()
    refit = simulate(runner, mixed_workload(runner.info.vocab_size))
    assert [r.out for r in refit] == [hf_greedy(other, r.prompt, MAX_NEW)[0] for r in refit]
    assert [r.out for r in refit] != [r.out for r in first]
    assert runner.release_weights() > 0
    assert runner.packed.nbytes == 0
    runner.resume_weights()
    load_weights(runner.model, iter_checkpoint(path))
    runner.reset()
    back = simulate(runner, mixed_workload(runner.info.vocab_size))
    assert [r.out for r in back] == [r.out for r in first]


def test_steps_with_prefill_work_are_cut_into_balanced_lanes(model_dirs: dict[str, str]) -> None:
    runner = _runner(model_dirs["llama"], lanes=2)

    def seq(prefix: int, new: int) -> SeqInput:
        return SeqInput(0, prefix, [1] * new, 0, [], SamplingParams(), [], [])

    # decode-only steps stay on one lane (split, each half pays the weights and fixed costs)
    assert runner._split_lanes([seq(100, 1)] * 8) == [(0, 8)]
    # two equal prompts: one each
    assert runner._split_lanes([seq(0, 200), seq(0, 200)]) == [(0, 1), (1, 2)]
    # decode sequences beside a prompt: the prompt is most of the work
    assert runner._split_lanes([seq(50, 1)] * 4 + [seq(0, 300)]) == [(0, 4), (4, 5)]
    # one sequence cannot be cut; tiny steps are not worth a thread
    assert runner._split_lanes([seq(0, 500)]) == [(0, 1)]
    assert runner._split_lanes([seq(0, 2), seq(0, 2)]) == [(0, 2)]
    assert _runner(model_dirs["llama"])._split_lanes([seq(0, 200)] * 2) == [(0, 2)]


def test_sampled_generation_is_seeded(model_dirs: dict[str, str]) -> None:
    path = model_dirs["qwen3"]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)

    def run(seed: int) -> list[list[int]]:
        runner = _runner(path, seed=seed)
        reqs = mixed_workload(runner.info.vocab_size)
        for r in reqs:
            r.params = params
        return [r.out for r in simulate(runner, reqs)]

    first = run(1)
    assert run(1) == first
    assert run(2) != first


def test_runner_attributes_and_reset(model_dirs: dict[str, str]) -> None:
    runner = _runner(model_dirs["qwen3"], context_length=64)
    with open(os.path.join(model_dirs["qwen3"], "config.json")) as f:
        cfg = json.load(f)
    assert runner.token_capacity == 1024
    assert runner.info.context_length == 64
    assert runner.req_to_token.shape == (8, 64)
    assert len(runner.k_caches) == cfg["num_hidden_layers"]
    assert runner.k_caches[0].shape == (1025, 2, 24)
    assert runner.kv_cache_bytes == 2 * 2 * 1025 * 2 * 24 * 4
    assert runner.weight_bytes > 0
    assert runner.forward_step([]) == []
    simulate(runner, [Req([5, 6, 7])], max_new=2)
    assert runner.req_to_token.abs().sum() > 0
    runner.reset()
    assert runner.req_to_token.abs().sum() == 0


def test_profiled_steps_are_named_by_what_they_run(model_dirs: dict[str, str]) -> None:
    """A profile names each step forward_extend or forward_decode: a prompt's last token
    after a cached prefix is a prefill (extend) though it is a 1-token row; a row whose
    token is an output is a decode."""
    runner = _runner(model_dirs["llama"], context_length=32)
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 6, 7, 8]
    cached_prompt = SeqInput(1, 3, prompt[3:], 0, [1, 2, 3, 4], greedy, prompt, [])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = runner.forward_step([SeqInput(0, 0, prompt, 0, [5, 6, 7, 8], greedy, prompt,
                                              [])])[0]
        runner.forward_step([cached_prompt])
        token = first.token_id
        runner.forward_step([SeqInput(0, 4, [token], 4, [9], greedy, prompt, [token])])
    names = [e.name for e in prof.events() if e.name.startswith("forward_")]
    assert names == ["forward_extend_bs1", "forward_extend_bs1", "forward_decode_bs1"]


def test_runner_rejects_bad_input(model_dirs: dict[str, str]) -> None:
    runner = _runner(model_dirs["llama"], context_length=32)
    params = SamplingParams()
    too_long = list(range(3, 40))
    with pytest.raises(ValueError, match="context length"):
        runner.forward_step([SeqInput(0, 0, too_long, 0, list(range(1, 38)), params,
                                      too_long, [])])
    with pytest.raises(ValueError, match="req_idx"):
        runner.forward_step([SeqInput(8, 0, [3], 0, [1], params, [3], [])])
    with pytest.raises(ValueError, match="slot"):
        runner.forward_step([SeqInput(0, 0, [3], 0, [5000], params, [3], [])])


def test_default_device_and_capacity(model_dirs: dict[str, str]) -> None:
    runner = ModelRunner(model_dirs["default"], max_running_requests=4)
    assert runner.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if runner.device.type == "cpu":
        assert runner.info.dtype == "float32"
        assert 0 < runner.token_capacity <= 65536
        assert runner.kv_cache_bytes <= (1 << 30) + 4096
    assert runner.info.context_length >= 4096


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied_llama3", "qwen3"])
def test_load_weights_replaces_a_checkpoint_in_place(
    model_dirs: dict[str, str], kind: str, tmp_path: Any
) -> None:
    """A runner on checkpoint A, then B copied in through load_weights: transformers' greedy
    tokens on B, with the fused q/k/v and gate/up matrices updated where they live."""
    other = str(tmp_path / f"{kind}-b")
    _build(kind, other, seed=99)
    runner = _runner(model_dirs[kind])
    attn, mlp = runner.model.model.layers[0].self_attn, runner.model.model.layers[0].mlp
    fused = (attn.qkv_weight.data_ptr(), mlp.gate_up_weight.data_ptr())
    loaded = load_weights(runner.model, iter_checkpoint(other))
    assert loaded == set(dict(runner.model.named_parameters(remove_duplicate=False)))
    assert (attn.qkv_weight.data_ptr(), mlp.gate_up_weight.data_ptr()) == fused
    reqs = simulate(runner, mixed_workload(runner.info.vocab_size))
    for r in reqs:
        expected, _ = hf_greedy(other, r.prompt, MAX_NEW)
        assert r.out == expected, f"{kind}: prompt of {len(r.prompt)} tokens"
    # B is not A: the same prompts give other tokens on A
    assert any(r.out != hf_greedy(model_dirs[kind], r.prompt, MAX_NEW)[0] for r in reqs)


def test_load_weights_names_the_mismatch(model_dirs: dict[str, str]) -> None:
    runner = _runner(model_dirs["qwen2"])
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(WeightMismatch, match=r"k_proj.weight.*shape \[3, 3\]"):
        load_weights(runner.model, [(name, torch.zeros(3, 3))])
    with pytest.raises(WeightMismatch, match="'model.layers.9.mlp.up_proj.weight' is not a"):
        load_weights(runner.model, [("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
def test_one_rows_sampling_fault_fails_that_row_alone(model_dirs: dict[str, str]) -> None:
    """A row whose sampling raises (here a logit_bias key that is no token id) or leaves no
    token (stop_token_ids covering the vocabulary before min_new_tokens) gets an error; the
    other rows of the same batch get the tokens they get alone."""
    runner = _runner(model_dirs["llama"])
    vocab = runner.info.vocab_size
    prompts = _prompts(vocab)[:4]
    params = [
        SamplingParams(),
        SamplingParams(logit_bias={"not-a-token": 1.0}),  # type: ignore[dict-item]
        SamplingParams(),
        SamplingParams(min_new_tokens=2, stop_token_ids=list(range(vocab))),
    ]

    def seq(row: int, prompt: list[int], p: SamplingParams, first_slot: int) -> SeqInput:
        slots = list(range(first_slot, first_slot + len(prompt)))
        return SeqInput(row, 0, prompt, 0, slots, p, prompt, [])

    batch, slot = [], 1
    for row, (prompt, p) in enumerate(zip(prompts, params)):
        batch.append(seq(row, prompt, p, slot))
        slot += len(prompt)
    results = runner.forward_step(batch)
    assert results[1] is not None and results[1].error_code == "INTERNAL"
    assert "sampling failed: ValueError" in (results[1].error or "")
    assert results[3] is not None and results[3].error_code == "INVALID_ARGUMENT"
    assert "min_new_tokens = 2" in (results[3].error or "")
    for row in (0, 2):
        alone = _runner(model_dirs["llama"]).forward_step([seq(0, prompts[row], params[0], 1)])
        assert results[row] is not None and results[row].error is None
        assert results[row].token_id == alone[0].token_id


def test_invalid_sequence_names_its_index(model_dirs: dict[str, str]) -> None:
    runner = _runner(model_dirs["llama"], context_length=32)
    params = SamplingParams()
    good = SeqInput(0, 0, [3, 4], 0, [1, 2], params, [3, 4], [])
    bad = SeqInput(9, 0, [3], 0, [3], params, [3], [])
    with pytest.raises(InvalidSequence, match="req_idx") as err:
        runner.forward_step([good, bad])
    assert err.value.index == 1
