"""The batched sampler on synthetic logits."""

from __future__ import annotations

import pytest
import torch

from sglang_admin.messages import SamplingParams
from sglang_admin.model.sampling import SampleRequest, apply_penalties, sample

V = 16
EOS = [15]


def req(prompt: list[int] | None = None, output: list[int] | None = None,
        **params: object) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), prompt or [], output or [])


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_fast_path_is_argmax() -> None:
    logits = logits_rows(5)
    result = sample(logits, [req() for _ in range(5)], EOS)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 5 and result.top_logprobs == [None] * 5


def test_top_k_one_equals_greedy() -> None:
    logits = logits_rows(8)
    gen = torch.Generator().manual_seed(0)
    reqs = [req(temperature=1.3, top_k=1) for _ in range(8)]
    assert sample(logits, reqs, EOS, gen).token_ids == logits.argmax(-1).tolist()


def test_logit_bias_forces_a_token() -> None:
    logits = logits_rows(6)
    gen = torch.Generator().manual_seed(0)
    reqs = [req(logit_bias={7: 100.0}), req(temperature=1.0, logit_bias={7: 100.0})] * 3
    assert sample(logits, reqs, EOS, gen).token_ids == [7] * 6
    banned = sample(logits[:1], [req(logit_bias={t: -1e9 for t in range(V) if t != 3})], EOS)
    assert banned.token_ids == [3]


def test_min_new_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, 15] = 10.0  # EOS
    logits[0, 4] = 9.0  # a stop token
    logits[0, 2] = 8.0
    params = dict(min_new_tokens=3, stop_token_ids=[4])
    assert sample(logits, [req(output=[1], **params)], EOS).token_ids == [2]
    assert sample(logits, [req(output=[1, 1, 1], **params)], EOS).token_ids == [15]
    # ignore_eos does not lift the min_new_tokens mask (SGLang semantics)
    assert sample(logits, [req(output=[], ignore_eos=True, **params)], EOS).token_ids == [2]


def test_repetition_penalty_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    logits = logits_rows(2)
    prompt, output = [1, 2, 3, 2], [5, 9]
    ours = logits.clone()
    apply_penalties(ours, [req(prompt, output, repetition_penalty=1.7),
                           req(prompt, output, repetition_penalty=0.6)], EOS)
    ids = torch.tensor([prompt + output])
    for row, penalty in enumerate([1.7, 0.6]):
        proc = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        want = proc(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], want)


def test_frequency_and_presence_penalties() -> None:
    logits = logits_rows(2)
    ours = logits.clone()
    output = [3, 3, 3, 8]
    apply_penalties(ours, [req([5], output, frequency_penalty=0.5, presence_penalty=0.25),
                           req([5], output)], EOS)
    want = logits[0].clone()
    want[3] -= 0.5 * 3 + 0.25
    want[8] -= 0.5 * 1 + 0.25
    torch.testing.assert_close(ours[0], want)
    torch.testing.assert_close(ours[1], logits[1])  # defaults: untouched


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.zeros(1, V)
    logits[0, 6] = 2.0
    logits[0, 9] = 1.5
    assert sample(logits, [req(output=[6])], EOS).token_ids == [6]
    assert sample(logits, [req(output=[6], presence_penalty=1.0)], EOS).token_ids == [9]
    assert sample(logits, [req(output=[6, 6], frequency_penalty=0.3)], EOS).token_ids == [9]
    assert sample(logits, [req(prompt=[6], repetition_penalty=1.5)], EOS).token_ids == [9]


def test_top_p_and_min_p_truncate() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    logits = probs.clamp_min(1e-12).log().expand(400, V).clone()
    gen = torch.Generator().manual_seed(0)
    got = set(sample(logits, [req(temperature=1.0, top_p=0.6)] * 400, EOS, gen).token_ids)
    assert got == {0, 1}
    got = set(sample(logits, [req(temperature=1.0, min_p=0.25)] * 400, EOS, gen).token_ids)
    assert got == {0, 1, 2}
    got = set(sample(logits, [req(temperature=1.0, top_k=3)] * 400, EOS, gen).token_ids)
    assert got == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)]).expand(4000, V).clone()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.tensor(sample(logits, [req(temperature=2.0)] * 4000, EOS, gen).token_ids)
    freq = torch.bincount(tokens, minlength=V)[:3].float() / 4000
    want = (logits[0, :3] / 2.0).softmax(-1)
    assert torch.allclose(freq, want, atol=0.03)


def test_sampling_is_reproducible_with_a_seed() -> None:
    logits = logits_rows(32)
    reqs = [req(temperature=1.0, top_p=0.95)] * 32
    a = sample(logits, reqs, EOS, torch.Generator().manual_seed(5)).token_ids
    b = sample(logits, reqs, EOS, torch.Generator().manual_seed(5)).token_ids
    c = sample(logits, reqs, EOS, torch.Generator().manual_seed(6)).token_ids
    assert a == b and a != c


def test_logprobs() -> None:
    logits = logits_rows(3)
    reqs = [
        SampleRequest(SamplingParams(repetition_penalty=2.0), [1, 2], [], True, 3),
        SampleRequest(SamplingParams(temperature=0.5), [], [], True, 0),
        SampleRequest(SamplingParams(), [], [], False, 0),
    ]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    # greedy: raw log-softmax (penalties do not change the reported logprobs)
    raw = logits[0].log_softmax(-1)
    assert result.logprobs[0] == pytest.approx(raw[result.token_ids[0]].item(), abs=1e-6)
    top = result.top_logprobs[0]
    assert top is not None and len(top) == 3
    assert [t for t, _ in top] == raw.topk(3).indices.tolist()
    # sampled: log-softmax of logits / temperature
    scaled = (logits[1] / 0.5).log_softmax(-1)
    assert result.logprobs[1] == pytest.approx(scaled[result.token_ids[1]].item(), abs=1e-6)
    assert result.top_logprobs[1] is None
    assert result.logprobs[2] is None and result.top_logprobs[2] is None


# ---------------------------------------------------------------- extreme values (issue 17)

FLOAT_MAX = torch.finfo(torch.float32).max


def _valid(result_tokens: list[int]) -> bool:
    return all(0 <= t < V for t in result_tokens)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e-40),
        dict(temperature=1e-38),
        dict(temperature=1e-45, top_k=5),
        dict(temperature=1e-7, top_p=0.5),
        dict(temperature=3e38, top_k=5, min_p=1.0),
        dict(temperature=1.0, logit_bias={3: 3e38}),
        dict(temperature=0.5, logit_bias={t: -3e38 for t in range(V)}),
        dict(logit_bias={t: -3e38 for t in range(V)}),
        dict(temperature=1.0, repetition_penalty=1e-40),
        dict(repetition_penalty=1e-40),
        dict(temperature=1e-6, repetition_penalty=2.0, frequency_penalty=2.0,
             presence_penalty=-2.0, logit_bias={1: 100.0, 2: -100.0}),
    ],
    ids=lambda p: ",".join(f"{k}={v if not isinstance(v, dict) else len(v)}"
                           for k, v in p.items()),
)
def test_extreme_finite_values_give_valid_tokens(params: dict) -> None:
    """Each of these once made torch.multinomial raise (or argmax pick garbage)."""
    logits = logits_rows(4, seed=3)
    gen = torch.Generator().manual_seed(0)
    reqs = [req(prompt=[1, 2, 3], output=[4], **params), req(), req(temperature=0.8), req()]
    result = sample(logits, reqs, EOS, gen)
    assert _valid(result.token_ids)
    assert result.errors == [None] * 4
    assert [result.token_ids[1], result.token_ids[3]] == [int(logits[1].argmax()),
                                                          int(logits[3].argmax())]


def test_extreme_temperature_below_epsilon_is_greedy() -> None:
    logits = logits_rows(3, seed=5)
    reqs = [req(temperature=1e-40), req(temperature=1e-38), req(temperature=1e-45, top_k=5)]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    assert result.token_ids == logits.argmax(-1).tolist()


def test_overflowing_bias_on_one_token_picks_that_token() -> None:
    logits = logits_rows(2, seed=6)
    reqs = [req(temperature=1.0, logit_bias={9: 3e38}), req(logit_bias={9: 3e38})]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    assert result.token_ids == [9, 9]


def test_repetition_penalty_tiny_never_raises_and_logprobs_are_finite() -> None:
    logits = logits_rows(2, seed=7)
    reqs = [
        SampleRequest(SamplingParams(temperature=1.0, repetition_penalty=1e-40), [1, 2], [3],
                      return_logprob=True, top_logprobs_num=3),
        SampleRequest(SamplingParams(repetition_penalty=1e-40), [1, 2], [3],
                      return_logprob=True, top_logprobs_num=3),
    ]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    assert _valid(result.token_ids) and result.errors == [None, None]
    assert all(lp is not None and lp == lp for lp in result.logprobs)  # not NaN


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_with_no_token_left_is_reported_and_others_proceed(temperature: float) -> None:
    """stop_token_ids covering the vocabulary with min_new_tokens 2: greedy used to return
    token 0 (garbage); now that row is marked and the rest of the batch is unaffected."""
    logits = logits_rows(3, seed=8)
    impossible = req(temperature=temperature, min_new_tokens=2, stop_token_ids=list(range(V)))
    reqs = [req(), impossible, req(temperature=0.7, top_k=3)]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    assert result.errors[0] is None and result.errors[2] is None
    assert result.errors[1] is not None and "min_new_tokens = 2" in result.errors[1]
    assert result.token_ids[0] == int(logits[0].argmax())
    assert _valid(result.token_ids)
    # once min_new_tokens is reached the mask lifts and the row samples normally again
    done = req(temperature=temperature, min_new_tokens=2, stop_token_ids=list(range(V)))
    done.output_ids = [1, 2]
    assert sample(logits[:1], [done], EOS, torch.Generator().manual_seed(0)).errors == [None]


def test_nan_and_inf_logits_are_sanitized() -> None:
    logits = logits_rows(2, seed=9)
    logits[0, 0] = float("nan")
    logits[0, 5] = float("inf")
    logits[1, :] = float("-inf")
    reqs = [req(temperature=1.0, logit_bias={1: 0.0}), req(temperature=1.0, logit_bias={1: 0.0})]
    result = sample(logits, reqs, EOS, torch.Generator().manual_seed(0))
    assert result.token_ids[0] == 5 and result.errors[0] is None
    assert result.errors[1] is not None
    assert result.errors[1].startswith("sampling_params leave no token to choose at output position 0")


@pytest.mark.parametrize(("params", "wants_logprobs", "expected"), [
    ({}, False, 0),
    ({"min_new_tokens": 3}, False, 3),  # EOS masked until then: not the argmax before
    ({"temperature": 0.7, "top_k": 1}, False, 0),
    ({"temperature": 0.7}, False, None),
    ({"repetition_penalty": 1.1}, False, None),
    ({"frequency_penalty": 0.5}, False, None),
    ({"presence_penalty": 0.5}, False, None),
    ({"logit_bias": {3: 1.0}}, False, None),
    ({}, True, None),
])
def test_argmax_from_is_where_the_token_becomes_the_plain_argmax(
    params: dict, wants_logprobs: bool, expected: int | None,
) -> None:
    """The runner skips sample() for rows past argmax_from: it must agree with sample()'s
    result there, and must not claim rows that sample() changes (penalties, bias, masking)."""
    from sglang_admin.messages import ARGMAX_NEVER

    sp = SamplingParams(**params)
    assert sp.argmax_from(wants_logprobs) == (ARGMAX_NEVER if expected is None else expected)
    if expected is not None:  # sample() takes the argmax at that output length
        logits = torch.randn(1, 16)
        req = SampleRequest(sp, [1, 2], [4] * expected, return_logprob=False)
        result = sample(logits, [req], [0], torch.Generator())
        assert result.token_ids == [int(logits.argmax())]


def test_draw_follows_the_distribution_and_never_picks_a_zero() -> None:
    """The cumulative-sum draw that replaced torch.multinomial: frequencies match the
    probabilities, and a token of probability 0 (first, middle or last) is never drawn."""
    from sglang_admin.model.sampling import _draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0]).expand(20000, 6).contiguous()
    drawn = _draw(probs, torch.Generator().manual_seed(3)).squeeze(1)
    freq = torch.bincount(drawn, minlength=6).float() / 20000
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs[0], atol=0.015)
    one_hot = torch.zeros(4, 6)
    one_hot[torch.arange(4), torch.tensor([0, 5, 2, 5])] = 1.0
    assert _draw(one_hot, None).squeeze(1).tolist() == [0, 5, 2, 5]


@pytest.mark.parametrize("params", [
    {"top_p": 0.9}, {"top_k": 50}, {"top_k": 3000}, {"min_p": 0.05}, {"top_p": 0.5, "top_k": 20},
    {"top_p": 0.999}, {"top_k": 3000, "top_p": 0.06},
])
@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_truncation_among_candidates_equals_a_full_sort(monkeypatch: pytest.MonkeyPatch,
                                                        params: dict, shape: str) -> None:
    """Top-k/top-p/min-p look at the best few tokens first (TRUNCATION_WIDTHS) and sort the
    whole row only when the kept set may reach beyond them: the same seed draws the same
    tokens either way (peaked rows stay among the candidates, flat ones fall back)."""
    import sglang_admin.model.sampling as sampling

    vocab = 5000
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, vocab, generator=gen) * (6.0 if shape == "peaked" else 0.3)
    reqs = [SampleRequest(SamplingParams(temperature=1.0, **params), [], [])] * 64
    fast = sample(logits, reqs, EOS, torch.Generator().manual_seed(11)).token_ids
    monkeypatch.setattr(sampling, "TRUNCATION_WIDTHS", ())  # always the full sort
    full = sample(logits, reqs, EOS, torch.Generator().manual_seed(11)).token_ids
    assert fast == full
