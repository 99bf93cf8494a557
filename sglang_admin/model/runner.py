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

import ctypes
import gc
import logging
import operator
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_admin.config import ATTENTION_BACKENDS
from sglang_admin.model.attention.choice import cuda_attention_applies
from sglang_admin.model.batch import BatchBuilder, ForwardBatch
from sglang_admin.model.cpu_dtype import auto_cpu_dtype
from sglang_admin.model.cpu_kernels import CpuKernels, load_cpu_kernels
from sglang_admin.model.decode_graphs import DecodeGraphs
from sglang_admin.model.device import (
    DEFAULT_MEM_FRACTION_STATIC,
    default_token_capacity,
    resolve_device,
    use_device,
)
from sglang_admin.model.grammar_mask import apply_grammar_masks
from sglang_admin.model.hidden_extras import hidden_rows, input_logprobs
from sglang_admin.model.lanes import LM_HEAD_SPLIT_PARAMS, SPLIT_MATMUL_PARAMS
from sglang_admin.model.llama import Linear, LlamaForCausalLM
from sglang_admin.model.loader import (
    ModelLoadError,
    dtype_from_name,
    load_model,
    load_model_info,
)
from sglang_admin.model.lora import LoraBuffers
from sglang_admin.model.packed_linear import PackedWeights, packed_linear, packing_available
from sglang_admin.model.pooling import pool
from sglang_admin.model.sampling import SampleRequest, SampleResult, sample
from sglang_admin.model.step_io import InvalidSequence, SeqInput, SeqOutput
from sglang_admin.scheduler.speculative import verify as spec_verify

__all__ = ["ForwardTimes", "InvalidSequence", "ModelRunner", "ResumeOutOfMemory", "SeqInput",
           "SeqOutput"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@dataclass(frozen=True, slots=True)
class ForwardTimes:
    """Seconds of one forward_step spent in the model (forward + logits) and in sampling."""

    model: float = 0.0
    sample: float = 0.0



def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """"auto" -> on CPU, model/cpu_dtype.py's rule (bfloat16 for a half-precision checkpoint
    on a CPU with native bfloat16, else float32); on CUDA the checkpoint's half dtype, else
    bfloat16."""
    if dtype != "auto":
        return dtype_from_name(dtype)
    if device.type != "cuda":
        return auto_cpu_dtype(checkpoint_dtype)
    if checkpoint_dtype in ("float16", "bfloat16"):
        return dtype_from_name(checkpoint_dtype)
    return torch.bfloat16


class ResumeOutOfMemory(RuntimeError):
    """Resuming released memory ran out of it; that memory stays released."""

    def __init__(self, tag: str, nbytes: int, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"resuming {tag} ({nbytes / 2**30:.2f} GiB) ran out of memory: {first}; "
                         f"{tag} stays released: free memory on the device, then resume again")
        self.tag = tag


class ModelRunner:
    """Forward + sampling for a continuous batch over a paged KV pool."""

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
        # weights kept quantized (model/quant/): activations as a half-precision checkpoint's
        self.dtype = resolve_dtype(dtype, self.device,
                                   "bfloat16" if quantization else probe.dtype)
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
        if lora_slots is not None and getattr(self.model, "quant", None) is not None:
            raise ModelLoadError("LoRA is not yet served on weights kept quantized (GGUF); "
                                 "serve with --gguf-dequantize to use adapters")
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
            "model %s loaded: %s on %s, %.1f MiB weights, KV pool %d tokens (%.1f MiB)",
            self.info.architectures, self.info.dtype, self.device, self.weight_bytes / 2**20,
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

    def _allocate_kv(self) -> None:
        """The KV pool: one allocation; per-layer K and V are contiguous views of it."""
        cfg = self.model.config
        self._kv = torch.zeros(
            cfg.num_layers, 2, self.token_capacity + 1, cfg.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )
        self.k_caches = [self._kv[i, 0] for i in range(cfg.num_layers)]
        self.v_caches = [self._kv[i, 1] for i in range(cfg.num_layers)]

    # ------------------------------------------------------------ memory occupation

    @property
    def kv_cache_released(self) -> bool:
        return self._kv is None

    @property
    def weights_released(self) -> bool:
        return self.model.model.embed_tokens.weight.is_meta

    def release_kv_cache(self) -> int:
        """Free the KV pool (the scheduler must hold no slot); bytes released."""
        if self._kv is None:
            return 0
        self._kv = None
        self.k_caches, self.v_caches = [], []
        if self.graphs is not None:  # they point at the pool: captured again after resume
            self.graphs.drop()
        self.batches.drop_scratch()
        self.reset()
        _return_memory(self.device)
        return self.kv_cache_bytes

    def resume_kv_cache(self) -> None:
        """Allocate the KV pool again (zeros); no-op when it is there. Raises
        :class:`ResumeOutOfMemory` (the pool still released) when it does not fit."""
        if self._kv is None:
            try:
                self._allocate_kv()
            except (torch.OutOfMemoryError, MemoryError) as exc:
                self._kv = None
                self.k_caches, self.v_caches = [], []
                _return_memory(self.device)
                raise ResumeOutOfMemory("kv_cache", self.kv_cache_bytes, exc) from None

    def release_weights(self) -> int:
        """Free every parameter (shapes kept); bytes released. Load weights after resuming."""
        if self.weights_released:
            return 0
        if getattr(self.model, "quant", None) is not None:
            raise ModelLoadError("weights kept quantized (GGUF) cannot be released and "
                                 "reloaded yet; serve with --gguf-dequantize for that")
        if self.packed is not None:
            self.packed.clear()
        if self.graphs is not None:  # they point at the weights: captured again after resume
            self.graphs.drop()
        self.model.release_parameters()
        _return_memory(self.device)
        return self.weight_bytes

    def resume_weights(self) -> None:
        """Storage for the weights again, uninitialised: the caller loads weights next.
        Raises :class:`ResumeOutOfMemory` (every weight released again) when they do not
        fit."""
        if self.weights_released:
            try:
                self.model.allocate_parameters(self.device)
            except (torch.OutOfMemoryError, MemoryError) as exc:
                self.model.release_parameters()  # what was allocated before the failure
                _return_memory(self.device)
                raise ResumeOutOfMemory("weights", self.weight_bytes, exc) from None

    def empty_cache(self) -> None:
        """Hand memory the allocator keeps cached back (CUDA's cached blocks; glibc's free
        arenas on CPU): the torch_empty_cache of ContinueGeneration and weight updates."""
        _return_memory(self.device)

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
            is_decode = not extend and all(s.prefix_len > 0 for s in decode)
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
        hidden = self._run_lanes(batch)
        sampled = batch.sampled
        if not sampled:
            self.last_times = ForwardTimes(model=time.perf_counter() - t_model)
            return self._with_extras({}, seqs, batch, hidden)
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

    def _split_lanes(self, ordered: list[SeqInput]) -> list[tuple[int, int]]:
        """See :meth:`BatchBuilder.split_lanes`."""
        return self.batches.split_lanes(ordered)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the rows that sample; on CPU with lanes and a large LM head, its
        vocabulary cut in one part per lane, computed at once by the lane threads (the head
        is a step's largest matmul: 2.8 GFLOP of SmolLM2-135M's batch-32 step, one thread)."""
        quant = getattr(self.model, "quant", None)
        if quant is not None and hidden.shape[0] > 0:  # model/quant/: the head kept quantized
            fallback = self._packed_linear if self.packed is not None else F.linear
            return quant.linear_with(fallback)(self.model.final_norm(hidden),
                                               self.model.output_weight(), None)
        if self.packed is not None and hidden.shape[0] > 0:
            return self._packed_linear(self.model.final_norm(hidden), self.model.output_weight(),
                                       None)
        cfg = self.model.config
        parts = self.lanes if cfg.vocab_size * cfg.hidden_size >= LM_HEAD_SPLIT_PARAMS else 1
        if parts <= 1 or self.device.type != "cpu" or hidden.shape[0] == 0:
            return self.model.compute_logits(hidden)
        normed = self.model.final_norm(hidden)
        vocab = cfg.vocab_size
        logits = torch.empty(hidden.shape[0], vocab, dtype=normed.dtype)

        def part(i: int) -> None:
            a, b = vocab * i // parts, vocab * (i + 1) // parts
            self.model.logits_into(normed, logits[:, a:b], a, b)

        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, parts)]
        part(0)
        for f in futures:
            f.result()
        return logits

    def _split_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with the weight's rows cut in one part per lane, the
        parts computed at once by the lane threads and this one (each streams its part of
        the weights once for every row of x): the C projection in float32, where it measured
        faster than torch's one-thread GEMM at these shapes (SmolLM2-135M's gate/up at 32
        rows: 1.85 vs 2.78 ms of CPU time), torch's elsewhere (bfloat16: oneDNN)."""
        parts, n = self.lanes, weight.shape[0]
        cuts = [n * i // parts for i in range(parts + 1)]
        kernels = self.cpu_kernels
        x = x.contiguous()
        in_c = kernels is not None and x.dtype == torch.float32 and weight.is_contiguous()
        if in_c:
            out = torch.empty(x.shape[0], n, dtype=torch.float32)

            def part(i: int) -> None:
                a, b = cuts[i], cuts[i + 1]
                kernels.linear(x, weight[a:b], None if bias is None else bias[a:b],
                               out=out[:, a:b])
        else:
            outs: list[torch.Tensor | None] = [None] * parts

            def part(i: int) -> None:
                a, b = cuts[i], cuts[i + 1]
                outs[i] = F.linear(x, weight[a:b], None if bias is None else bias[a:b])
        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, parts)]
        part(0)
        for f in futures:
            f.result()
        return out if in_c else torch.cat(outs, dim=1)  # type: ignore[arg-type]

    def _packed_linear(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with packed weights (model/packed_linear.py), the
        weight's rows cut in one part per lane, the parts computed at once by the lane
        threads and this one (each streams its part of the weights once)."""
        assert self.packed is not None
        parts = self.packed.parts(weight, bias, self.lanes)
        x = x.contiguous()
        if len(parts) == 1:
            return packed_linear(x, parts[0])
        outs: list[torch.Tensor | None] = [None] * len(parts)

        def part(i: int) -> None:
            outs[i] = packed_linear(x, parts[i])

        futures = [self._lanes_pool().submit(_in_inference_mode, part, i)
                   for i in range(1, len(parts))]
        part(0)
        for f in futures:
            f.result()
        return torch.cat(outs, dim=1)  # type: ignore[arg-type]

    def _packed_whole(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear`` with packed weights, uncut: what each lane of a step cut into lanes
        runs."""
        assert self.packed is not None
        return packed_linear(x.contiguous(), self.packed.parts(weight, bias, 1)[0])

    def _lanes_pool(self) -> ThreadPoolExecutor:
        """The lane threads (lanes past the first), started at first use."""
        if self._lane_pool is None:
            # a new thread does not inherit torch's thread count: without this, each lane
            # would start an OpenMP team of the machine's size, whose threads spin
            self._lane_pool = ThreadPoolExecutor(
                self.lanes - 1, thread_name_prefix="lane",
                initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        return self._lane_pool

    def _run_lanes(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of every new token: one forward per lane, lanes past the first on
        the lane threads while this thread computes the first; joined in token order."""
        lanes, offsets, metas = batch.lanes, batch.offsets, batch.metas
        ids, positions = batch.input_ids, batch.positions
        decode = metas[0].paged_decode
        if self.graphs is not None and decode is not None and metas[0].num_decode == len(ids):
            hidden = self.graphs.run(ids, positions, metas[0].out_slots, decode.rows,
                                     decode.lengths)
            if hidden is not None:  # a decode batch no larger than the graphs' largest
                return hidden

        def run(i: int, linear: Linear | None = None) -> torch.Tensor:
            a, b = offsets[lanes[i][0]], offsets[lanes[i][1]]
            return self.model(ids[a:b], positions[a:b], metas[i], self.k_caches, self.v_caches,
                              linear)

        quant = getattr(self.model, "quant", None)
        if len(lanes) == 1:
            if quant is not None:  # model/quant/: projections kept quantized
                return run(0, quant.linear_with(
                    self._packed_linear if self.packed is not None else F.linear))
            if self.packed is not None:
                return run(0, self._packed_linear)
            decode_only = ids.shape[0] == len(batch.ordered)
            return run(0, self._split_linear if self.split_matmuls and decode_only else None)
        whole = self._packed_whole if self.packed is not None else None
        if quant is not None:
            whole = quant.linear_with(whole or F.linear)
        futures = [self._lanes_pool().submit(_in_inference_mode, run, i, whole)
                   for i in range(1, len(lanes))]
        first = run(0, whole)
        return torch.cat([first, *(f.result() for f in futures)])

    def _sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SeqOutput]:
        """Sample the whole batch at once; when that raises, row by row, so that only the
        rows that raise on their own fail (with the reason)."""
        eos = self.info.eos_token_ids
        try:
            result = sample(logits, reqs, eos, self.generator)
        except Exception as exc:  # noqa: BLE001 - isolate the request(s) that caused it
            logger.warning("batch sampling failed (%s: %s); sampling row by row",
                           type(exc).__name__, exc)
            outputs: list[SeqOutput] = []
            for i, r in enumerate(reqs):
                try:
                    one = sample(logits[i : i + 1], [r], eos, self.generator)
                except Exception as row_exc:  # noqa: BLE001
                    outputs.append(SeqOutput(
                        0, error=f"sampling failed: {type(row_exc).__name__}: {row_exc}",
                        error_code="INTERNAL",
                    ))
                    continue
                outputs.append(_seq_output(one, 0))
            return outputs
        return [_seq_output(result, i) for i in range(len(reqs))]

    def _with_extras(self, by_seq: dict[int, SeqOutput], seqs: list[SeqInput],
                     batch: ForwardBatch, hidden: torch.Tensor) -> list[SeqOutput | None]:
        """The step's outputs in ``seqs`` order, with what some sequences asked for beside
        the token: hidden states of sampled rows and prompt logprobs (model/hidden_extras.py;
        a sequence that sampled nothing gets an output only for its prompt logprobs)."""
        ordered, sampled = batch.ordered, batch.sampled
        if not self.info.is_generation:  # Embed requests' vectors (model/pooling.py)
            self._pool(by_seq, ordered, batch.offsets, hidden)
        if not any(s.return_hidden_states or s.logprob_start_len >= 0 for s in ordered):
            return [by_seq.get(id(s)) for s in seqs]
        if any(s.return_hidden_states for s in sampled):
            wanted = [s.return_hidden_states for s in sampled]
            for s, state in zip(sampled, hidden_rows(self.model, hidden, batch.select, wanted)):
                by_seq[id(s)].hidden_state = state
        if any(s.logprob_start_len >= 0 for s in ordered):
            for key, entries in input_logprobs(self.model, hidden, ordered, batch.offsets).items():
                by_seq.setdefault(key, SeqOutput(-1)).input_logprobs = entries
        return [by_seq.get(id(s)) for s in seqs]

    def _pool(self, by_seq: dict[int, SeqOutput], ordered: list[SeqInput], offsets: list[int],
              hidden: torch.Tensor) -> None:
        """Each embed sequence's vector at its last chunk; a failure of pooling fails the
        step's embed sequences alone (INTERNAL)."""
        try:
            pooled = pool(self.model, hidden, ordered, offsets)
        except Exception as exc:  # noqa: BLE001 - the embed requests fail, the rank serves
            logger.exception("pooling failed")
            pooled = {id(s): f"pooling failed: {type(exc).__name__}: {exc}"
                      for s in ordered if s.embed is not None}
        for key, value in pooled.items():
            if isinstance(value, str):
                by_seq[key] = SeqOutput(-1, error=value, error_code="INTERNAL")
            else:
                by_seq[key] = SeqOutput(-1, embedding=value)


def _seq_output(result: SampleResult, i: int) -> SeqOutput:
    error = result.errors[i]
    out = SeqOutput(result.token_ids[i], result.logprobs[i], result.top_logprobs[i], error,
                    "INVALID_ARGUMENT" if error is not None else None)
    if result.token_ids_logprobs:
        out.token_ids_logprobs = result.token_ids_logprobs[i]
    return out

def _in_inference_mode(fn, *args):  # noqa: ANN001, ANN202 - a lane thread's entry
    """Run fn(*args) under torch.inference_mode (a per-thread mode: lane threads need it)."""
    with torch.inference_mode():
        return fn(*args)


def keep_freed_cpu_memory() -> None:
    """Let glibc keep freed memory for the next step instead of giving it back at once.

    A forward pass allocates and frees megabytes of activations; by default glibc serves
    such blocks with mmap and unmaps them when freed, so every step pays page faults on
    fresh memory (a fifth of a CPU prefill step here: docs/benchmarks.md). Blocks up to
    32 MiB now come from the heap, which is trimmed past 1 GiB of free space; the memory
    release RPCs still hand everything back (``_return_memory`` trims).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _return_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks, or glibc's arenas on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
