"""A response handed over already serialized goes out as it is; any other is serialized."""

from __future__ import annotations

import grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.errors import Serialized
from sglang_admin.server.interceptors import error_wrapped


async def _answer(request: pb.GetServerInfoRequest, context: object) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse()


def test_the_wrapped_serializer_passes_serialized_answers_and_serializes_the_rest() -> None:
    handler = error_wrapped("/svc/GetServerInfo", grpc.unary_unary_rpc_method_handler(
        _answer, request_deserializer=pb.GetServerInfoRequest.FromString,
        response_serializer=pb.GetServerInfoResponse.SerializeToString))
    serialize = handler.response_serializer
    static = pb.GetServerInfoResponse(sglang_version="v", max_total_num_tokens=7)
    live = pb.GetServerInfoResponse(active_requests=2, rank_states=[pb.RankState(dp_rank=1)])
    data = serialize(Serialized(static.SerializeToString() + live.SerializeToString()))
    assert type(data) is bytes
    merged = pb.GetServerInfoResponse.FromString(data)  # the two parts, merged
    assert (merged.sglang_version, merged.max_total_num_tokens) == ("v", 7)
    assert merged.active_requests == 2 and [s.dp_rank for s in merged.rank_states] == [1]
    assert serialize(live) == live.SerializeToString()
    # wrapped again (an interceptor over the registered handler): still one check
    again = error_wrapped("/svc/GetServerInfo", handler)
    assert again.response_serializer is serialize
