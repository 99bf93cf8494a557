"""The server <-> rank codec (messages/codec.py): what goes in comes out, and nothing else does."""

from __future__ import annotations

import msgpack
import pytest

from sglang_admin.messages import (
    AdminReply,
    BatchOutput,
    FlushResult,
    GenerateReq,
    RankState,
    ReqOutput,
    SamplingParams,
    decode,
    encode,
)


def _outputs() -> list[ReqOutput]:
    plain = ReqOutput("a", [17], 5, 1, 0)
    rich = ReqOutput(
        "b", [3, 4], 12, 9, 4, logprobs=[-0.5, -1.25], top_logprobs=[[[3, -0.5], [8, -2.0]]],
        finish_reason="stop", matched_token_id=4, queue_time_s=0.125, index=2,
        matched_stop_str="</s>", stop_trim=1, input_logprobs=[None, -3.0],
        input_top_logprobs=[[[1, -0.1]]], token_ids_logprobs=[[[9, -7.5]]],
        hidden_states=[[0.5, -1.0]])
    failed = ReqOutput("c", [], 3, 0, 0, finish_reason="abort", error="invalid sequence",
                       error_code="INTERNAL")
    return [plain, rich, failed]


def test_a_step_of_outputs_round_trips() -> None:
    """BatchOutput, the one message of every step (its outputs packed as plain arrays)."""
    msg = BatchOutput(1, _outputs())
    assert decode(encode(msg)) == msg
    assert decode(encode(BatchOutput(0, []))) == BatchOutput(0, [])


def test_an_output_with_a_field_past_index_set_keeps_it() -> None:
    """Outputs whose fields after ``index`` hold their defaults travel short; any one of
    those fields set (even alone, even falsy-looking) makes the output travel whole."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(ReqOutput)]
    values = {"logprobs": [-0.5], "top_logprobs": [[[3, -0.5]]], "finish_reason": "length",
              "matched_token_id": 0, "error": "", "error_code": "", "matched_stop_str": "",
              "stop_trim": 2, "input_logprobs": [None], "input_top_logprobs": [[]],
              "token_ids_logprobs": [[]], "hidden_states": [[0.0]], "embedding": [0.25],
              "spec_verify_ct": 3, "spec_draft_tokens": 5, "spec_accepted_tokens": 2}
    assert sorted(values) == sorted(names[names.index("index") + 1:])  # every such field
    for name, value in values.items():
        out = ReqOutput("r", [1], 2, 1, 0, 0.5, 1, **{name: value})
        assert decode(encode(BatchOutput(0, [out]))).outputs == [out], name
    short = BatchOutput(0, [ReqOutput("r", [1], 2, 1, 0, 0.5, 1)])
    whole = BatchOutput(0, [ReqOutput("r", [1], 2, 1, 0, 0.5, 1, stop_trim=1)])
    assert len(encode(short)) < len(encode(whole))


def test_a_short_output_decodes_with_the_dataclass_defaults_in_fresh_lists() -> None:
    """A short output decodes to the whole dataclass, its lists each output's own (the
    server's stream buffers extend them)."""
    got = decode(encode(BatchOutput(0, [ReqOutput("a", [1], 2, 1, 0),
                                        ReqOutput("b", [2], 2, 1, 0)]))).outputs
    assert got == [ReqOutput("a", [1], 2, 1, 0), ReqOutput("b", [2], 2, 1, 0)]
    got[0].logprobs.append(-1.0)
    got[0].hidden_states.append([1.0])
    assert got[1].logprobs == [] and got[1].hidden_states == []


def test_nested_messages_round_trip() -> None:
    req = GenerateReq("r1", [1, 2, 3], SamplingParams(temperature=0.7, top_k=5,
                                                       stop_token_ids=[2]))
    assert decode(encode(req)) == req
    state = RankState(0, num_running_reqs=3, decode_phase_s={"model": 1.5})
    reply = AdminReply("x", 0, True, "ok", state)
    assert decode(encode(reply)) == reply
    assert decode(encode(AdminReply("y", 1, True, result=FlushResult(7)))).result == FlushResult(7)


def test_only_registered_messages_cross() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        encode(AdminReply("z", 0, True, result=object()))
    with pytest.raises(TypeError, match="not a ReqOutput"):
        encode(BatchOutput(0, [object()]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="unknown message code"):
        decode(msgpack.packb(msgpack.ExtType(120, msgpack.packb([]))))
    with pytest.raises(ValueError, match="not a registered message"):
        decode(msgpack.packb([1, 2]))
