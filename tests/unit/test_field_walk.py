"""Every field of every request message of the wire proto (smg-grpc-proto's
SglangScheduler) is read by the worker, refused with a status naming it, or has no effect on
any answer for a reason written here. A proto bump that adds a field fails
``test_every_request_field_is_accounted_for`` until the field is placed in FIELDS.

Each entry: ``("read", file)`` (the module, under sglang_admin/, that reads it: the test
checks the file names the field), ``("refused", reason)`` (for Generate's and Embed's fields
the test sends a value and checks INVALID_ARGUMENT naming the field) or ``("no_effect",
reason)``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from sglang_admin.messages import ModelInfo
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.embedding_service import embed_from_proto
from sglang_admin.server.errors import ServiceError
from sglang_admin.server.generate_codec import Limits, generate_from_proto

PKG = Path(__file__).resolve().parents[2] / "sglang_admin"

MM = "refused: inside mm_inputs, which is refused (this worker serves no multimodal model)"
PD = ("refused: inside disaggregated_params, which is refused (this worker runs no "
      "prefill/decode disaggregation)")
TEXT_ONLY = ("the worker answers token ids and the router detokenizes (SGLang's gRPC servicer "
             "runs with skip_tokenizer_init, so it does not read it either); stop strings are "
             "matched on the plain decode")

FIELDS: dict[str, tuple[str, str]] = {
    # ---- Generate
    "GenerateRequest.request_id": ("read", "server/generation_service.py"),
    "GenerateRequest.tokenized": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.mm_inputs": ("refused", "this worker serves no multimodal model"),
    "GenerateRequest.sampling_params": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.return_logprob": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.logprob_start_len": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.top_logprobs_num": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.token_ids_logprob": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.return_hidden_states": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.disaggregated_params": ("refused", "no prefill/decode disaggregation"),
    "GenerateRequest.custom_logit_processor": ("refused", "no code from a request is run"),
    "GenerateRequest.timestamp": (
        "no_effect", "SGLang records it for its request-latency metrics only; this worker "
                     "times a request from its arrival"),
    "GenerateRequest.log_metrics": (
        "no_effect", "SGLang's switch for counting a request in its metrics; proto3 cannot "
                     "tell false from unset, so honouring false would drop every client that "
                     "leaves it unset from the metrics: every request counts"),
    "GenerateRequest.input_embeds": ("refused", "prompts are token ids"),
    "GenerateRequest.lora_id": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.data_parallel_rank": ("read", "server/generation_service.py"),
    "GenerateRequest.stream": ("read", "server/generate_codec/request.py"),
    "GenerateRequest.require_reasoning": ("read", "server/generation_service.py"),
    "TokenizedInput.original_text": ("read", "server/generate_codec/request.py"),
    "TokenizedInput.input_ids": ("read", "server/generate_codec/request.py"),
    "SamplingParams.temperature": ("read", "server/generate_codec/request.py"),
    "SamplingParams.top_p": ("read", "server/generate_codec/request.py"),
    "SamplingParams.top_k": ("read", "server/generate_codec/request.py"),
    "SamplingParams.min_p": ("read", "server/generate_codec/request.py"),
    "SamplingParams.frequency_penalty": ("read", "server/generate_codec/request.py"),
    "SamplingParams.presence_penalty": ("read", "server/generate_codec/request.py"),
    "SamplingParams.repetition_penalty": ("read", "server/generate_codec/request.py"),
    "SamplingParams.max_new_tokens": ("read", "server/generate_codec/request.py"),
    "SamplingParams.stop": ("read", "server/generate_codec/request.py"),
    "SamplingParams.stop_token_ids": ("read", "server/generate_codec/request.py"),
    "SamplingParams.skip_special_tokens": ("no_effect", TEXT_ONLY),
    "SamplingParams.spaces_between_special_tokens": ("no_effect", TEXT_ONLY),
    "SamplingParams.regex": ("read", "server/generate_codec/request.py"),
    "SamplingParams.json_schema": ("read", "server/generate_codec/request.py"),
    "SamplingParams.ebnf_grammar": ("read", "server/generate_codec/request.py"),
    "SamplingParams.structural_tag": ("read", "server/generate_codec/request.py"),
    "SamplingParams.n": ("read", "server/generate_codec/request.py"),
    "SamplingParams.min_new_tokens": ("read", "server/generate_codec/request.py"),
    "SamplingParams.ignore_eos": ("read", "server/generate_codec/request.py"),
    "SamplingParams.no_stop_trim": ("read", "server/generate_codec/request.py"),
    "SamplingParams.stream_interval": ("read", "server/generate_codec/request.py"),
    "SamplingParams.logit_bias": ("read", "server/generate_codec/request.py"),
    "SamplingParams.custom_params": ("refused", "read only by a custom logit processor"),
    "LogitBiasEntry.key": ("read", "server/generate_codec/request.py"),
    "LogitBiasEntry.value": ("read", "server/generate_codec/request.py"),
    "MultimodalInputs.*": ("refused", MM),
    "TensorData.*": ("refused", MM),
    "ModelSpecificTensorsEntry.*": ("refused", MM),
    "PlaceholderRange.*": ("refused", MM),
    "DisaggregatedParams.*": ("refused", PD),
    # ---- Embed
    "EmbedRequest.request_id": ("read", "server/embedding_service.py"),
    "EmbedRequest.tokenized": ("read", "server/embedding_service.py"),
    "EmbedRequest.mm_inputs": ("refused", "this worker serves no multimodal model"),
    "EmbedRequest.sampling_params": ("refused", "an embedding samples no token"),
    "EmbedRequest.token_type_ids": ("refused", "the embedding models served take no segments"),
    "EmbedRequest.data_parallel_rank": ("read", "server/embedding_service.py"),
    "EmbedRequest.is_cross_encoder": ("refused", "this worker serves no reranker"),
    "EmbedRequest.texts": ("refused", "this worker does not tokenize text"),
    # ---- the rest
    "AbortRequest.request_id": ("read", "server/generation_service.py"),
    "AbortRequest.reason": ("read", "server/generation_service.py"),
    "GetLoadsRequest.dp_rank": ("read", "server/info_service.py"),
    "GetLoadsRequest.include": ("read", "server/info_service.py"),
    "FlushCacheRequest.timeout_s": ("read", "server/cache_profile_service.py"),
    "StartProfileRequest.output_dir": ("read", "server/profiles.py"),
    "StartProfileRequest.start_step": ("read", "server/profiles.py"),
    "StartProfileRequest.num_steps": ("read", "server/profiles.py"),
    "StartProfileRequest.activities": ("read", "server/profiles.py"),
    "StartProfileRequest.with_stack": ("read", "server/profiles.py"),
    "StartProfileRequest.record_shapes": ("read", "server/profiles.py"),
    "StartProfileRequest.profile_by_stage": ("read", "server/profiles.py"),
    "SubscribeKvEventsRequest.start_sequence_number": ("read", "server/info_service.py"),
    "SubscribeKvEventsRequest.load_records_before_first_batch": (
        "read", "server/info_service.py"),
    "LoadLoRAAdapterRequest.lora_name": ("read", "server/lora_service.py"),
    "LoadLoRAAdapterRequest.lora_path": ("read", "server/lora_service.py"),
    "LoadLoRAAdapterRequest.pinned": ("read", "server/lora_service.py"),
    "LoadLoRAAdapterRequest.lora_id": ("read", "server/lora_service.py"),
    "UnloadLoRAAdapterRequest.lora_name": ("read", "server/lora_service.py"),
    "UnloadLoRAAdapterRequest.lora_id": ("read", "server/lora_service.py"),
}

# Runs in a child process: smg-grpc-proto defines the same package as our stubs.
_DUMP = r"""
import json
from smg_grpc_proto import sglang_scheduler_pb2 as m
seen = {}
def walk(d):
    if d.full_name in seen or d.full_name.startswith("google."):
        return
    seen[d.full_name] = [f.name for f in d.fields]
    for f in d.fields:
        if f.message_type is not None:
            walk(f.message_type)
for meth in m.DESCRIPTOR.services_by_name["SglangScheduler"].methods:
    walk(meth.input_type)
print(json.dumps({k.rsplit(".", 1)[-1]: v for k, v in seen.items()}))
"""


@pytest.fixture(scope="module")
def wire() -> dict[str, list[str]]:
    pytest.importorskip("smg_grpc_proto")
    out = subprocess.run([sys.executable, "-c", _DUMP], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def _entry(message: str, name: str) -> tuple[str, str] | None:
    return FIELDS.get(f"{message}.{name}") or FIELDS.get(f"{message}.*")


def test_every_request_field_is_accounted_for(wire: dict[str, list[str]]) -> None:
    missing = [f"{m}.{f}" for m, names in wire.items() for f in names if _entry(m, f) is None]
    assert not missing, (
        "request fields of smg-grpc-proto that the worker neither reads nor refuses (place "
        f"each in FIELDS with where it is read or why it is refused): {missing}")
    assert sum(len(v) for v in wire.values()) > 80


def test_no_entry_names_a_field_the_wire_lacks(wire: dict[str, list[str]]) -> None:
    stale = [key for key in FIELDS
             if key.split(".")[0] not in wire
             or (not key.endswith(".*") and key.split(".")[1] not in wire[key.split(".")[0]])]
    assert not stale, stale


def test_read_fields_are_named_where_they_are_read() -> None:
    for key, (kind, where) in FIELDS.items():
        if kind != "read":
            continue
        text = (PKG / where).read_text()
        name = key.split(".")[1]
        if name in ("key", "value"):  # map entries: the map is iterated with .items()
            assert "logit_bias.items()" in text, key
            continue
        assert name in text, f"{key} is said to be read in {where}, which does not name it"


def test_no_effect_fields_say_why() -> None:
    for key, (kind, reason) in FIELDS.items():
        assert kind in ("read", "refused", "no_effect"), key
        if kind != "read":
            assert len(reason) > 20, f"{key}: say why"


LIMITS = Limits(vocab_size=261, context_length=8192, token_capacity=65536, dp_size=2)
INFO = ModelInfo(model_path="/m", tokenizer_path=None, architectures=["LlamaModel"],
                 model_type="llama", vocab_size=261, context_length=8192, eos_token_ids=[1],
                 bos_token_id=None, pad_token_id=None, num_layers=1, num_attention_heads=1,
                 num_kv_heads=1, head_dim=8, hidden_size=8, dtype="float32",
                 token_capacity=65536, is_generation=False, embedding_dim=8, pooling="LAST")


def _struct() -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({"a": 1})
    return s


# a value for each refused top-level field of Generate (on a valid request) and Embed
GENERATE_REFUSED = {
    "mm_inputs": lambda r: r.mm_inputs.image_urls.append("http://x/i.png"),
    "disaggregated_params": lambda r: setattr(r.disaggregated_params, "bootstrap_host", "h"),
    "custom_logit_processor": lambda r: setattr(r, "custom_logit_processor", "x"),
    "input_embeds": lambda r: r.input_embeds.append(0.5),
    "custom_params": lambda r: r.sampling_params.custom_params.CopyFrom(_struct()),
}
EMBED_REFUSED = {
    "mm_inputs": lambda r: r.mm_inputs.image_urls.append("http://x/i.png"),
    "sampling_params": lambda r: r.sampling_params.CopyFrom(pb.SamplingParams(temperature=1)),
    "token_type_ids": lambda r: r.token_type_ids.extend([0, 1]),
    "is_cross_encoder": lambda r: setattr(r, "is_cross_encoder", True),
    "texts": lambda r: r.texts.append("hello"),
}


def test_the_table_and_the_refusal_cases_agree() -> None:
    refused = {k.split(".")[1] for k, (kind, _) in FIELDS.items()
               if kind == "refused" and k.split(".")[0] in ("GenerateRequest", "SamplingParams")}
    assert refused == set(GENERATE_REFUSED)
    refused = {k.split(".")[1] for k, (kind, _) in FIELDS.items()
               if kind == "refused" and k.startswith("EmbedRequest.")}
    assert refused == set(EMBED_REFUSED)


@pytest.mark.parametrize("name", sorted(GENERATE_REFUSED))
def test_a_refused_generate_field_is_refused_naming_it(name: str) -> None:
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
    generate_from_proto(request, "rid", LIMITS)  # valid without it
    GENERATE_REFUSED[name](request)
    with pytest.raises(ServiceError) as err:
        generate_from_proto(request, "rid", LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.message


@pytest.mark.parametrize("name", sorted(EMBED_REFUSED))
def test_a_refused_embed_field_is_refused_naming_it(name: str) -> None:
    request = pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
    embed_from_proto(request, "rid", INFO)  # valid without it
    EMBED_REFUSED[name](request)
    with pytest.raises(ServiceError) as err:
        embed_from_proto(request, "rid", INFO)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.message
