"""check-weights' verdict over many targets, and how the refit subcommands read, without a
server: the renderers and the summary are plain functions of the responses."""

from __future__ import annotations

import pytest

from sglang_admin.client.commands import report
from sglang_admin.client.fanout import TargetResult
from sglang_admin.client.refit_commands import (
    render_check_weights,
    render_get_weights,
    render_pause,
    summarize_digests,
)
from sglang_admin.pb import common_pb2 as pb


def checked(target: str, *digests: str) -> TargetResult[pb.CheckWeightsResponse]:
    ranks = [pb.RankResult(dp_rank=i, success=bool(d), digest=d) for i, d in enumerate(digests)]
    same = len(set(digests)) == 1 and all(digests)
    resp = pb.CheckWeightsResponse(success=same, rank_results=ranks,
                                   digest=digests[0] if same else "")
    return TargetResult(target, value=resp)


def test_same_digests_everywhere_agree(capsys: pytest.CaptureFixture[str]) -> None:
    results = [checked("a:1", "d1", "d1"), checked("b:2", "d1", "d1")]
    summary = summarize_digests(results)
    assert summary.ok and summary.data == {"all_agree": True}
    assert summary.text == "all 2 target(s), 4 rank(s) in all, agree: d1"
    assert report(results, render_check_weights, as_json=False, summary=summary) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("a:1  OK  digest=d1") and out[1] == "    rank 0: d1"
    assert out[-1] == summary.text


def test_targets_that_differ_fail_even_when_each_succeeded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = [checked("a:1", "d1"), checked("b:2", "d2")]
    summary = summarize_digests(results)
    assert not summary.ok and "DIFFER: 2 distinct digests over 2 rank(s)" in summary.text
    assert report(results, render_check_weights, as_json=True, summary=summary) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all('"all_agree": false' in ln for ln in lines)


def test_a_target_without_digests_leaves_the_verdict_open() -> None:
    failed: TargetResult[pb.CheckWeightsResponse] = TargetResult(
        "b:2", code="UNAVAILABLE", error="down")
    for other in (failed, checked("b:2", "")):
        summary = summarize_digests([checked("a:1", "d1"), other])
        assert not summary.ok and summary.text.startswith("cannot tell")


def test_pause_and_get_weights_read_per_rank() -> None:
    pause = render_pause(pb.PauseGenerationResponse(
        success=True, message="Generation paused (retract): 3 request(s)",
        num_paused_requests=3,
        rank_results=[pb.RankResult(dp_rank=0, success=True, num_paused_requests=1),
                      pb.RankResult(dp_rank=1, success=True, num_paused_requests=2)]))
    assert pause.ok and "num_paused_requests=3" in pause.text
    assert pause.details == ["rank 0: OK  paused=1", "rank 1: OK  paused=2"]
    values = render_get_weights(pb.GetWeightsByNameResponse(
        success=True, shape=[2, 8], values=[float(i) for i in range(10)]))
    assert values.text == "shape=[2, 8] values (10): [0, 1, 2, 3, 4, 5, 6, 7, ...]"
    failed = render_get_weights(pb.GetWeightsByNameResponse(
        success=False, message="the model has no parameter named 'x'"))
    assert not failed.ok and "no parameter named" in failed.text
