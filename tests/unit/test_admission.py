"""Generate admission (server/admission.py): the derived limit and the count in flight."""

from __future__ import annotations

import grpc
import pytest

from sglang_admin.config import ServerArgs
from sglang_admin.server.admission import GenerateAdmission, derived_limit
from sglang_admin.server.errors import ServiceError


@pytest.mark.parametrize(("running", "pool", "dp", "limit"), [
    (64, 65536, 2, 2 * 256),  # 4 batches of 64 in flight per rank
    (64, 4096, 1, 128),  # the pool at 32 tokens a call
    (64, 0, 1, 256),  # pool not known yet
    (64, 100, 3, 3 * 64),  # never below one full batch per rank
])
def test_derived_limit(running: int, pool: int, dp: int, limit: int) -> None:
    assert derived_limit(running, pool, dp) == limit


def test_calls_past_the_limit_are_refused_and_places_come_back() -> None:
    admission = GenerateAdmission(ServerArgs(max_inflight_generate=2), lambda: 65536)
    with admission.admit(), admission.admit():
        assert admission.in_flight == 2
        with pytest.raises(ServiceError) as exc, admission.admit():
            pass
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 Generate calls in flight, the limit is 2 (--max-inflight-generate)" in (
            exc.value.message)
        assert admission.refused == 1 and admission.in_flight == 2
    assert admission.in_flight == 0
    with pytest.raises(RuntimeError), admission.admit():  # a call that fails frees its place
        raise RuntimeError("boom")
    assert admission.in_flight == 0


def test_the_default_follows_the_pool_once_known() -> None:
    pool = [0]
    admission = GenerateAdmission(ServerArgs(dp_size=2, max_running_requests=8), lambda: pool[0])
    assert admission.limit == 2 * 4 * 8
    pool[0] = 640  # 20 calls of 32 tokens per rank
    assert admission.limit == 2 * 20
    with admission.admit():
        pass  # the message names where the figure comes from
    admission.in_flight = admission.limit
    with pytest.raises(ServiceError) as exc, admission.admit():
        pass
    assert "derived from --max-running-requests and the KV pool" in exc.value.message
