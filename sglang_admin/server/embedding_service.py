"""The Embed RPC: a tokenized input run as a prefill-only request on a rank, answered with
the model's pooled vector (an embedding model) or score logits (a classifier)."""

from __future__ import annotations

import time
import uuid

import grpc

from sglang_admin.config import ServerArgs
from sglang_admin.messages import GenerateReq, ModelInfo, ReqOutput, SamplingParams
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server.admin import AdminCalls
from sglang_admin.server.communicator import Communicator, RankUnavailable
from sglang_admin.server.errors import MAX_REQUEST_ID_CHARS, ServiceError, invalid
from sglang_admin.server.stream_buffer import StreamOverflow
from sglang_admin.tracing import carrier_from_metadata, server_span

NOT_AN_EMBEDDING_MODEL = (
    "This model does not appear to be an embedding model by default. Please add "
    "`--is-embedding` when launching the server to serve it through Embed "
    "(base-model and *ForSequenceClassification checkpoints are embedding models anyway)")
NOT_A_GENERATION_MODEL = (
    "Generate is not served: this worker serves {what} through Embed ({archs}{flag}); "
    "start it without `--is-embedding` on a *ForCausalLM checkpoint to generate")


def refuse_generate(args: ServerArgs, info: ModelInfo | None) -> None:
    """FAILED_PRECONDITION for a Generate call on an embedding or classification model."""
    if info is None or info.is_generation:
        return
    what = "a classification model" if info.num_labels else "an embedding model"
    flag = ", --is-embedding" if args.is_embedding else ""
    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, NOT_A_GENERATION_MODEL.format(
        what=what, archs=", ".join(info.architectures) or "unknown architecture", flag=flag))


def embed_from_proto(request: pb.EmbedRequest, rid: str, info: ModelInfo) -> GenerateReq:
    """Validate an EmbedRequest against the served model; the rank's prefill-only message."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if request.HasField("mm_inputs"):
        raise invalid("mm_inputs is not supported by this worker")
    if request.is_cross_encoder:
        raise invalid("is_cross_encoder is not supported: this worker serves no reranker")
    if any(request.token_type_ids):
        raise invalid("token_type_ids is not supported: this worker's embedding models take "
                      "no segment ids (all zeros or none)")
    if request.HasField("sampling_params"):
        raise invalid("sampling_params is not supported by Embed: an embedding samples no "
                      "token (leave the field unset)")
    if request.texts:
        raise invalid("texts is not supported: this worker does not tokenize text (the router "
                      "sends tokenized.input_ids)")
    ids = list(request.tokenized.input_ids)
    if not ids:
        if request.tokenized.original_text:
            raise invalid("tokenized.input_ids must not be empty: this worker does not "
                          "tokenize text (the router sends token ids)")
        raise invalid("tokenized.input_ids must not be empty")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise invalid(f"tokenized.input_ids[{bad}] = {ids[bad]} is outside the vocabulary "
                      f"of {info.vocab_size} tokens")
    if len(ids) > info.context_length:
        raise invalid(f"input of {len(ids)} tokens exceeds the context length "
                      f"{info.context_length}")
    if len(ids) >= info.token_capacity:
        raise invalid(f"input of {len(ids)} tokens exceeds the KV pool of "
                      f"{info.token_capacity} tokens")
    return GenerateReq(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=0),
                       embed=True)


class Embedding:
    """Embed: one vector per call, batched by the rank's scheduler with other requests."""

    def __init__(self, args: ServerArgs, comm: Communicator, admin: AdminCalls) -> None:
        self.args = args
        self.comm = comm
        self.admin = admin

    async def embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        self.admin.require_ready()
        info = self.comm.model_info
        assert info is not None
        if info.is_generation:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, NOT_AN_EMBEDDING_MODEL)
        rid = request.request_id or f"embed-{uuid.uuid4().hex}"
        if self.comm.is_inflight(rid):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {rid!r} is already in flight")
        req = embed_from_proto(request, rid, info)
        remaining = context.time_remaining()
        if remaining is not None:
            req.deadline = time.time() + remaining
        # EmbedRequest.data_parallel_rank is a plain int32: 0 cannot be told from unset, so
        # (as SGLang's servicer) only a non-zero value pins the rank
        pinned = request.data_parallel_rank
        if pinned and not 0 <= pinned < self.args.dp_size:
            raise invalid(f"data_parallel_rank = {pinned} is out of range "
                          f"[0, {self.args.dp_size - 1}]")
        rank = self.comm.pick_rank(pinned or None)
        carrier = carrier_from_metadata(context.invocation_metadata())
        final: ReqOutput | None = None
        with server_span("Embed", carrier, request_id=rid) as forward:
            req.trace = forward
            self.admin.log("embed", rid, carrier, rank=rank, prompt_tokens=len(req.input_ids))
            try:
                async for out in self.comm.metrics.observe(self.comm.generate(req, rank), rank):
                    if out.error:
                        code = getattr(grpc.StatusCode, out.error_code or "INTERNAL")
                        raise ServiceError(code, out.error)
                    if out.finish_reason is not None:
                        final = out
                        break
            except RankUnavailable as exc:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            except StreamOverflow as exc:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if final is None or final.finish_reason == "abort":
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {rid!r} was aborted")
        if not final.embedding:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"request {rid!r} ended without a vector")
        self.admin.log("embed_done", rid, carrier, embedding_dim=len(final.embedding))
        return pb.EmbedResponse(embedding_dim=len(final.embedding), embedding=final.embedding,
                                prompt_tokens=final.prompt_tokens)
