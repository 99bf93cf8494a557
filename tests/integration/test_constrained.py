"""Constrained decoding over gRPC (generated stubs) against a real worker.

The embedded default model has random weights and a byte-level vocabulary (ids 0..255 are
the bytes, 257 and 259 end a sequence): whatever it would say, the grammar decides what it
may say, so every output below must match its constraint exactly.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
import xgrammar as xgr

from sglang_admin.model.default_model import ensure_default_model
from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ServerProc, run_generate

EOS = (257, 259)
PROMPT = [72, 101, 108, 108, 111]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def check_person(value: object) -> None:
    """PERSON_SCHEMA, checked by hand."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and re.fullmatch("[a-z]{1,8}", value["name"])
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in ("a", "b", "c") for t in value["tags"])


def constrained(
    *, temperature: float = 1.0, max_new: int = 200, seed: int = 0, stream: bool = False,
    logprobs: bool = False, **constraint: str,
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPT + [seed % 250]),
        sampling_params=pb.SamplingParams(
            temperature=temperature, max_new_tokens=max_new, **constraint),
        stream=stream,
        return_logprob=logprobs,
        top_logprobs_num=2 if logprobs else 0,
    )


def text_of(ids: list[int]) -> str:
    assert all(t < 256 or t in EOS for t in ids), ids
    return bytes(t for t in ids if t < 256).decode("utf-8")


def finished_by_grammar(ids: list[int], complete: pb.GenerateComplete) -> str:
    """The output text of a request the grammar ended: "stop" on a stop token."""
    assert complete.finish_reason == "stop", complete
    assert ids and ids[-1] in EOS and complete.matched_token_id == ids[-1]
    return text_of(ids[:-1])


def parses_with(grammar: str, text: str) -> bool:
    """Whether ``text`` is a complete sentence of the EBNF ``grammar`` (xgrammar's parser)."""
    compiled = xgr.Grammar.from_ebnf(grammar)
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(_tokenizer_info()).compile_grammar(compiled),
        terminate_without_stop_token=True,
    )
    return matcher.accept_string(text) and matcher.is_completed()


def _tokenizer_info() -> xgr.TokenizerInfo:
    from tokenizers import Tokenizer

    from sglang_admin.scheduler.grammar import tokenizer_info

    tok = Tokenizer.from_file(f"{ensure_default_model()}/tokenizer.json")
    return tokenizer_info(tok, 261, EOS)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_regex_output_fully_matches(server: ServerProc, stream: bool) -> None:
    stub = server.stub()
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for seed in range(4):
        ids, complete = run_generate(
            stub, constrained(regex=pattern, seed=seed, stream=stream), timeout=120)
        assert re.fullmatch(pattern, finished_by_grammar(ids, complete))


def test_regex_greedy_with_logprobs(server: ServerProc) -> None:
    ids, complete = run_generate(
        server.stub(), constrained(regex="[0-9]{3}-[0-9]{4}", temperature=0, logprobs=True),
        timeout=120,
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", finished_by_grammar(ids, complete))
    lp = complete.output_logprobs
    assert list(lp.token_ids) == ids and len(lp.token_logprobs) == len(ids)
    assert all(v <= 0 and v > float("-inf") for v in lp.token_logprobs)
    assert len(lp.top_logprobs) == len(ids)
    for row, tok in zip(lp.top_logprobs, ids):
        assert row.token_ids[0] == tok  # greedy: the chosen token is the best allowed


def test_ebnf_output_parses_with_its_grammar(server: ServerProc) -> None:
    stub = server.stub()
    for seed in range(3):
        ids, complete = run_generate(
            stub, constrained(ebnf_grammar=ARITHMETIC, seed=seed), timeout=120)
        text = finished_by_grammar(ids, complete)
        assert parses_with(ARITHMETIC, text), text
        assert not parses_with(ARITHMETIC, text + ")")  # the check can fail


def test_json_schema_output_parses_and_validates(server: ServerProc) -> None:
    stub = server.stub()
    schema = json.dumps(PERSON_SCHEMA)
    for seed in range(3):
        ids, complete = run_generate(
            stub, constrained(json_schema=schema, seed=seed, max_new=400), timeout=120)
        check_person(json.loads(finished_by_grammar(ids, complete)))


def test_structural_tag_output(server: ServerProc) -> None:
    """xgrammar's structural tag format (a tag whose content is a JSON schema) is enforced;
    SGLang's legacy format (free text until a trigger) compiles and serves."""
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {"enum": [1, 2]}},
    }})
    stub = server.stub()
    for seed in range(2):
        ids, complete = run_generate(
            stub, constrained(structural_tag=tag, seed=seed, max_new=40), timeout=120)
        assert re.fullmatch("<f>[12]</f>", finished_by_grammar(ids, complete))
    legacy = json.dumps({
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"enum": [1, 2]}, "end": "</f>"}],
        "triggers": ["<f>"],
    })
    ids, complete = run_generate(
        stub, constrained(structural_tag=legacy, max_new=40, temperature=0), timeout=120)
    free_text = bytes(t for t in ids if t < 256).decode(errors="replace")
    for call in re.findall("<f>(.*?)</f>", free_text):
        assert call in ("1", "2")
    assert complete.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "constraint, needle",
    [
        ({"regex": "[a-z"}, "Unclosed '['"),
        ({"json_schema": '{"type": "objec"}'}, 'Unsupported type "objec"'),
        ({"json_schema": "{not json"}, "json_schema does not compile"),
        ({"ebnf_grammar": "root ::= undefined_rule"}, 'Rule "undefined_rule" is not defined'),
    ],
    ids=["regex", "schema-type", "schema-json", "ebnf"],
)
def test_bad_constraint_is_invalid_argument_and_the_server_keeps_serving(
    server: ServerProc, constraint: dict[str, str], needle: str
) -> None:
    stub = server.stub()
    for stream in (False, True):
        with pytest.raises(grpc.RpcError) as err:
            run_generate(stub, constrained(stream=stream, **constraint), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
    ids, complete = run_generate(stub, constrained(regex="ok", temperature=0), timeout=60)
    assert finished_by_grammar(ids, complete) == "ok"


def test_constrained_and_free_requests_side_by_side(server: ServerProc) -> None:
    """One batch: a constrained row next to unconstrained ones; the free ones are what they
    would be alone (the mask touches only its own row)."""
    from concurrent.futures import ThreadPoolExecutor

    stub = server.stub()
    free = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
    )
    alone, _ = run_generate(stub, free, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run_generate, stub, free, timeout=120) for _ in range(2)]
        futures.append(pool.submit(
            run_generate, stub, constrained(regex="[xyz]{20}", temperature=0), timeout=120))
        results = [f.result() for f in futures]
    assert results[0][0] == alone and results[1][0] == alone
    assert re.fullmatch("[xyz]{20}", finished_by_grammar(*results[2]))



def test_n_samples_each_follow_the_grammar(server: ServerProc) -> None:
    """n > 1: every sample has its own matcher (one compile); each output matches."""
    pattern = r"[a-z]{3,6}(-[0-9]{1,3}){2}"
    for stream in (False, True):
        req = constrained(regex=pattern, stream=stream, seed=5)
        req.sampling_params.n = 3
        completes: dict[int, pb.GenerateComplete] = {}
        streamed: dict[int, list[int]] = {}
        for resp in server.stub().Generate(req, timeout=120):
            if resp.HasField("chunk"):
                streamed.setdefault(resp.chunk.index, []).extend(resp.chunk.token_ids)
            else:
                completes[resp.complete.index] = resp.complete
        assert sorted(completes) == [0, 1, 2]
        for index, c in completes.items():
            ids = streamed[index] if stream else list(c.output_ids)
            assert re.fullmatch(pattern, finished_by_grammar(ids, c))
    bad = constrained(regex="[a-z", seed=5)
    bad.sampling_params.n = 2
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub().Generate(bad, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unclosed '['" in err.value.details()
