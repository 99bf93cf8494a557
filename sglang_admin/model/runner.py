"""ModelRunner: owns the model and the paged KV pool, and runs one step: prepare the batch
(model/batch.py), run the model, sample.

One ``forward_step`` runs one forward pass for a whole continuous batch (decode sequences
and prefill chunks together) and samples one token for every sequence that asks for one.

The KV pool holds, per layer, a K and a V tensor of shape
``[max_total_tokens + 1, num_kv_heads, head_dim]``. Slot 0 is a scratch slot that the
scheduler never hands out. ``req_to_token[req_idx, pos]`` is the pool slot of position
``pos`` of the sequence living in row ``req_idx``.
"""

from __future__ import annotations

import logging
import operator
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sglang_admin.config import ATTENTION_BACKENDS
from sglang_admin.model.attention.choice import cuda_attention_applies
from sglang_admin.model.batch import BatchBuilder
from sglang_admin.model.cpu_dtype import choose_dtype, gguf_weight_type
from sglang_admin.model.cpu_kernels import CpuKernels
from sglang_admin.model.cpu_kernels_build import load_cpu_kernels
from sglang_admin.model.decode_graphs import DecodeGraphs
from sglang_admin.model.device import (
    DEFAULT_MEM_FRACTION_STATIC,
    default_token_capacity,
    resolve_device,
    use_device,
)
from sglang_admin.model.grammar_mask import apply_grammar_masks
from sglang_admin.model.lanes import SPLIT_MATMUL_PARAMS
from sglang_admin.model.llama import LlamaForCausalLM
from sglang_admin.model.loader import (
    ModelLoadError,
    load_model,
    load_model_info,
)
from sglang_admin.model.lora import LoraBuffers
from sglang_admin.model.packed_linear import PackedWeights, packing_available
from sglang_admin.model.runner_lanes import RunnerLanes
from sglang_admin.model.runner_memory import (
    ResumeOutOfMemory,
    RunnerMemory,
    keep_freed_cpu_memory,
    resolve_dtype,
)
from sglang_admin.model.runner_outputs import RunnerOutputs
from sglang_admin.model.sampling import SampleRequest
from sglang_admin.model.step_io import InvalidSequence, SeqInput, SeqOutput
from sglang_admin.scheduler.speculative import verify as spec_verify

__all__ = ["ForwardTimes", "InvalidSequence", "ModelRunner", "ResumeOutOfMemory", "SeqInput",
           "SeqOutput", "keep_freed_cpu_memory", "resolve_dtype"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class ForwardTimes:
    """Seconds of one forward_step spent in the model (forward + logits) and in sampling."""

    model: float = 0.0
    sample: float = 0.0



class ModelRunner(RunnerMemory, RunnerLanes, RunnerOutputs):
    """Forward + sampling for a continuous batch over a paged KV pool: the model, its pools and
    one step here; the memory occupation (runner_memory.py), the lane threads' work and the
    logits (runner_lanes.py), sampling and the outputs' extras (runner_outputs.py) in the
    classes it mixes in."""

    def __init__(
        self,
        model_path: str | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_total_tokens: int | None = None,
        max_running_requests: int = 64,
        context_length: int | None = None,
        seed: int = 0,
        lora_slots: tuple[int, int] | None = None,
        lanes: int = 1,
        attention_backend: str = "auto",
        gpu_index: int = 0,
        mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC,
        is_embedding: bool = False,
        tensor_parallel: object = None,
        lanes_as_threads: bool = True,
        cuda_graph_max_bs: int = 0,
        quantization: str = "",
    ) -> None:
        if model_path is None:
            from sglang_admin.model.default_model import ensure_default_model

            model_path = ensure_default_model()
        self.device = resolve_device(device, gpu_index)
        use_device(self.device)
        probe = load_model_info(model_path, context_length)
        dtype_choice = choose_dtype(dtype, self.device, probe.dtype,
                                    gguf_weight_type(model_path))
        self.dtype = dtype_choice.dtype
        self.model: LlamaForCausalLM
        self.model, self.info = load_model(
            model_path, dtype=self.dtype, device=self.device, context_length=context_length,
            is_embedding=is_embedding, tensor_parallel=tensor_parallel,
            quantization=quantization,
        )
        # CUDA: the Triton decode kernel and mask-free prefix prefill (model/attention/choice.py)
        mcfg = self.model.config
        cuda_attention = cuda_attention_applies(self.device, attention_backend, mcfg.num_heads,
                                                mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        if tensor_parallel is not None:  # the C decode layer has no all-reduce: torch's ops
            attention_backend = "torch_native"
        self.weight_bytes = self.info.weight_bytes
        self.context_length = self.info.context_length
        self.max_running_requests = max_running_requests
        # LoRA adapter slots (count, max rank), allocated before the KV pool is sized
        self.lora: LoraBuffers | None = None
        # weights kept quantized (model/quant/): the base matmuls go through the store, the
        # adapters' deltas are added to their outputs as on dense weights
        if lora_slots is not None:
            self.lora = LoraBuffers(self.model, *lora_slots, self.dtype, self.device)
        cfg = self.model.config
        windows = {w for w in cfg.sliding_windows if w is not None}
        if len(windows) > 1:
            raise ModelLoadError(f"{model_path}: several different sliding windows {windows}")
        self.sliding_window: int | None = windows.pop() if windows else None

        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
        if max_total_tokens is None:
            max_total_tokens = default_token_capacity(
                self.device, per_token, mem_fraction_static=mem_fraction_static,
                max_useful_tokens=max_running_requests * self.context_length)
        if max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be positive, got {max_total_tokens}")
        self.token_capacity = max_total_tokens
        self.kv_cache_bytes = (max_total_tokens + 1) * per_token
        self._kv: torch.Tensor | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self._allocate_kv()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # CPU: a step's sequences are cut into this many lanes, each computed by a thread of
        # its own (threads that block when done, unlike OpenMP's, which spin: see
        # _split_lanes); CUDA and LoRA run one lane
        self.lanes = max(1, lanes) if self.device.type == "cpu" else 1
        # a large model on CPU (packed projections below): with ``lanes_as_threads`` (the
        # default unless --cpu-lanes or --torch-threads is given) its lanes become OpenMP
        # threads of one lane, which computes its GEMMs faster than lane threads cutting the
        # rows (docs/cpu-performance.md)
        large_cpu = (self.device.type == "cpu" and tensor_parallel is None
                     and self._decoder_params() >= SPLIT_MATMUL_PARAMS)
        self.packed: PackedWeights | None = (
            PackedWeights() if large_cpu and packing_available() else None)
        if self.packed is not None and lanes_as_threads and self.lanes > 1:
            torch.set_num_threads(self.lanes * torch.get_num_threads())
            self.lanes = 1
        self._lane_pool: ThreadPoolExecutor | None = None
        # CPU float32 and bfloat16: decode attention read in place from the pool; RMSNorm,
        # RoPE and SwiGLU in one pass each (model/cpu_kernels.py)
        self.cpu_kernels = self._cpu_kernels(attention_backend)
        self.model.use_cpu_kernels(self.cpu_kernels)
        if self.cpu_kernels is not None and getattr(self.model, "quant", None) is not None:
            from sglang_admin.model.quant import decode_step  # batch 1's plan, made at load

            decode_step.plan_ahead(self.model)
        # whether prefill chunks may go through the kernel (this build, this head size)
        extend_kernel = (self.cpu_kernels is not None
                         and self.cpu_kernels.extend_applies(cfg.head_dim, self.dtype))
        # the request-to-token table and the step's index tensors (model/batch.py)
        self.batches = BatchBuilder(
            device=self.device, dtype=self.dtype, max_running_requests=max_running_requests,
            context_length=self.context_length, token_capacity=self.token_capacity,
            sliding_window=self.sliding_window, num_heads=cfg.num_heads,
            kv_width=cfg.num_kv_heads * cfg.head_dim, cpu_kernels=self.cpu_kernels,
            extend_kernel=extend_kernel, lanes=self.lanes, cuda_attention=cuda_attention)
        # a large model on CPU: every projection and the LM head through oneDNN with packed
        # weights (model/packed_linear.py), each weight's rows cut among the lane threads if
        # there are several (not under tensor parallelism: its all-reduces hang on the
        # projection modules); without packing, decode-only steps cut each projection among
        # the lane threads
        self.split_matmuls = self.packed is None and large_cpu and self.lanes > 1
        self.last_times = ForwardTimes()  # the last forward_step's split, for step_timing
        # CUDA graphs for decode batches (model/decode_graphs.py), off unless asked for
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_bs > 0:
            self.graphs = self._decode_graphs(cuda_graph_max_bs, cuda_attention, tensor_parallel)
        logger.info(
            "model %s loaded: %s on %s (%s), %.1f MiB weights, KV pool %d tokens (%.1f MiB)",
            self.info.architectures, self.info.dtype, self.device, dtype_choice.reason,
            self.weight_bytes / 2**20,
            self.token_capacity, self.kv_cache_bytes / 2**20,
        )

    def _decode_graphs(self, max_bs: int, cuda_attention: bool,
                       tensor_parallel: object) -> DecodeGraphs | None:
        """Decode graphs up to ``max_bs`` sequences, captured now (on CUDA; on CPU they run
        eagerly, for the tests): where the Triton decode kernel runs, without LoRA or tensor
        parallelism; else None (logged)."""
        if not cuda_attention or self.lora is not None or tensor_parallel is not None:
            logger.info("CUDA graphs off: they need the CUDA attention path, no LoRA and no "
                        "tensor parallelism")
            return None
        from sglang_admin.model.attention.triton_decode import split_count

        cfg = self.model.config
        graphs = DecodeGraphs(
            lambda ids, positions, meta: self.model(ids, positions, meta, self.k_caches,
                                                    self.v_caches),
            self.batches.req_to_token, min(max_bs, self.max_running_requests),
            lambda size: split_count(size, cfg.num_kv_heads, self.context_length),
            cfg.num_heads, cfg.head_dim, self.device, capture=self.device.type == "cuda")
        try:
            with torch.inference_mode():
                graphs.capture()
        except Exception as exc:  # noqa: BLE001 - an opt-in speed-up: the rank serves without
            logger.warning("CUDA graph capture failed (%s: %s): decode steps run eagerly",
                           type(exc).__name__, exc)
            return None
        return graphs

    def _decoder_params(self) -> int:
        """Parameters of the decoder layers' matmuls (what a token's projections multiply)."""
        cfg = self.model.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)
        return cfg.num_layers * per_layer

    def _cpu_kernels(self, backend: str) -> CpuKernels | None:
        """``auto``: the CPU kernels where they apply (float32 or bfloat16 on CPU) and build;
        ``torch_native``: never; ``cpu_paged``: required (ModelLoadError otherwise)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if backend == "torch_native":
            return None
        applies = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        kernel = load_cpu_kernels() if applies else None
        if kernel is not None and self.dtype == torch.bfloat16 and not kernel.bf16:
            kernel = None  # its bfloat16 half disagreed with torch at load (logged)
        if backend == "cpu_paged" and kernel is None:
            raise ModelLoadError(
                "attention backend cpu_paged needs float32 or bfloat16 on CPU and a C compiler "
                "that builds model/csrc/cpu_kernels.c (see the log); use auto or torch_native")
        if kernel is not None:
            logger.info("CPU kernels: %s", kernel.path)
        return kernel

    def reset(self) -> None:
        """Forget every sequence's slots (cache flush); the KV tensors are left as they are."""
        self.batches.reset()

    @property
    def req_to_token(self) -> torch.Tensor:
        """[max_running_requests, context_length]: the pool slot of each sequence's positions."""
        return self.batches.req_to_token

    # ------------------------------------------------------------ one step

    def forward_step(self, seqs: list[SeqInput]) -> list[SeqOutput | None]:
        """One forward pass over the batch, then sampling; None where ``sample`` is False.

        Raises :class:`InvalidSequence` (before any device work) when a sequence is
        invalid; a sequence whose sampling raised or left no token gets a
        :class:`SeqOutput` with ``error`` and the others are unaffected. An exception of the
        forward pass itself propagates: it may have poisoned the device.
        """
        if not seqs:
            return []
        if any([s.draft for s in seqs]):  # speculative verify sequences
            return self._verify_step(seqs)
        # decode sequences (one new token) first, then the extend sequences
        decode: list[SeqInput] = []
        extend: list[SeqInput] = []
        for s in seqs:
            (decode if len(s.token_ids) == 1 else extend).append(s)
        with torch.inference_mode():
            if not torch._C._autograd._profiler_enabled():  # the label costs ~10 us a step
                return self._forward_step(seqs, decode, extend)
            # a 1-token row is a decode when its token is an output (a prompt's last token
            # after a cached prefix is a prefill)
            is_decode = not extend and all(s.prefix_len >= len(s.prompt_ids) for s in decode)
            label = f"forward_{'decode' if is_decode else 'extend'}_bs{len(seqs)}"
            with torch.profiler.record_function(label):  # a profile's step names
                return self._forward_step(seqs, decode, extend)

    def _verify_step(self, seqs: list[SeqInput]) -> list[SeqOutput | None]:
        """A step with speculative verify sequences (scheduler/speculative/verify.py): each becomes one
        decode row per position, run with the step's other sequences as one batch; each
        verify sequence's output is its accepted run."""
        for i, s in enumerate(seqs):
            if s.draft:
                problem = spec_verify.invalid(s)
                if problem is None:
                    try:
                        self.batches._validate(s)
                    except ValueError as exc:
                        problem = str(exc)
                if problem is not None:
                    raise InvalidSequence(i, problem)
        flat, origin, rows = spec_verify.expand(seqs)
        try:
            outs = self.forward_step(flat)
        except InvalidSequence as exc:
            raise InvalidSequence(origin[exc.index], str(exc)) from None
        return spec_verify.collect(seqs, rows, outs)

    def _forward_step(self, seqs: list[SeqInput], decode: list[SeqInput],
                      extend: list[SeqInput]) -> list[SeqOutput | None]:
        """Prepare the batch, run the model, sample (see :meth:`forward_step`)."""
        batch = self.batches.prepare(seqs, decode, extend, one_lane=self.lora is not None)
        if self.lora is not None:  # which adapter each token runs with
            self.lora.prepare([s.lora_slot for s in batch.ordered for _ in range(len(s.token_ids))])
        t_model = time.perf_counter()
        one = batch.metas[0] if len(batch.lanes) == 1 else None
        if one is not None:  # the decode step may compute the LM head in its call
            one.want_logits = batch.every_row and self.device.type == "cpu"
        hidden = self._run_lanes(batch)
        sampled = batch.sampled
        if not sampled:
            self.last_times = ForwardTimes(model=time.perf_counter() - t_model)
            return self._with_extras({}, seqs, batch, hidden)
        logits = one.logits if one is not None and one.want_logits else None
        if logits is None:
            logits = self._compute_logits(
                hidden if batch.every_row else hidden.index_select(0, batch.select))
        if self.device.type == "cuda":  # sampling reads the tokens back anyway: no loss
            torch.cuda.synchronize(self.device)
        t_sample = time.perf_counter()
        if all([len(s.output_ids) >= s.argmax_from for s in sampled]):
            outs = self._argmax(logits)
            self.last_times = ForwardTimes(model=t_sample - t_model,
                                           sample=time.perf_counter() - t_sample)
            if len(sampled) == len(seqs) and all(map(operator.is_, sampled, seqs)):
                return outs  # type: ignore[return-value]  # all sampled, in order: decode
            by_seq = {id(s): out for s, out in zip(sampled, outs)}
        else:
            by_seq = self._sample_batch(logits, sampled)
            self.last_times = ForwardTimes(model=t_sample - t_model,
                                           sample=time.perf_counter() - t_sample)
        return self._with_extras(by_seq, seqs, batch, hidden)

    def _argmax(self, logits: torch.Tensor) -> list[SeqOutput]:
        """sample()'s answer when every row is greedy, without building its requests."""
        tokens = (self.cpu_kernels.argmax(logits)
                  if self.cpu_kernels is not None and logits.is_contiguous()
                  else logits.float().argmax(dim=-1).tolist())  # torch's bf16 argmax is slow
        return [SeqOutput(token) for token in tokens]

    def _sample_batch(self, logits: torch.Tensor,
                      sampled: list[SeqInput]) -> dict[int, SeqOutput]:
        """Grammar masks, then sampling; each sampled sequence's output by its id()."""
        grammar_failed = apply_grammar_masks(logits, [s.grammar for s in sampled])
        reqs = [
            SampleRequest(s.sampling, s.prompt_ids, s.output_ids, s.return_logprob,
                          s.top_logprobs_num, s.token_ids_logprob if s.return_logprob else None)
            for s in sampled
        ]
        by_seq: dict[int, SeqOutput] = {}
        for s, out in zip(sampled, self._sample(logits, reqs)):
            by_seq[id(s)] = out
        for row, reason in grammar_failed.items():
            by_seq[id(sampled[row])] = SeqOutput(0, error=reason, error_code="INTERNAL")
        return by_seq


