"""ModelRunner: owns the model, the paged KV pool and the request-to-token table.

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
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sglang_admin.config import ATTENTION_BACKENDS
from sglang_admin.messages import ARGMAX_NEVER, SamplingParams
from sglang_admin.model.cpu_kernels import (
    EXTEND_MAX_TOKENS,
    CpuKernels,
    DecodeBatch,
    load_cpu_kernels,
)
from sglang_admin.model.grammar_mask import TokenMatcher, apply_grammar_masks
from sglang_admin.model.host_index import StagingBuffer, host_table
from sglang_admin.model.lanes import group_by_length, lane_cuts
from sglang_admin.model.llama import (
    AttentionMetadata,
    DecodeGroup,
    ExtendSeq,
    LlamaForCausalLM,
)
from sglang_admin.model.loader import (
    ModelLoadError,
    dtype_from_name,
    load_model,
    load_model_info,
)
from sglang_admin.model.lora import LoraBuffers
from sglang_admin.model.output_extras import hidden_rows, input_logprobs
from sglang_admin.model.pooling import PoolProgress, pool
from sglang_admin.model.sampling import SampleRequest, SampleResult, sample

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_CPU_MAX_TOKENS = 65536


@dataclass(slots=True)
class SeqInput:
    """One sequence of a batch: its new tokens and where their K/V live."""

    req_idx: int  # row in the request-to-token table, 0 <= req_idx < max_running_requests
    prefix_len: int  # tokens of this sequence whose K/V already sit in the pool
    token_ids: list[int]  # new tokens, at positions prefix_len .. prefix_len+len-1
    table_start: int  # table_slots go to req_to_token[req_idx, table_start:...]
    table_slots: list[int]  # after the write, row[:prefix_len+len(token_ids)] is the sequence
    sampling: SamplingParams
    prompt_ids: list[int]  # the prompt (repetition penalty); not copied
    output_ids: list[int]  # generated so far (penalties, min_new_tokens)
    sample: bool = True  # False: a non-final prefill chunk, produce no token
    return_logprob: bool = False
    top_logprobs_num: int = 0
    lora_slot: int = -1  # the LoRA adapter's slot (model/lora.py); -1: the base model
    logprob_start_len: int = -1  # >= 0: logprobs of prompt[logprob_start_len:] (prefill)
    token_ids_logprob: list[int] | None = None  # logprobs of these ids (return_logprob)
    return_hidden_states: bool = False
    grammar: TokenMatcher | None = None  # constrained decoding: masks the sampled logits
    # from this output length on, the token is the logits' argmax and nothing else is asked
    # (ARGMAX_NEVER: never); None: worked out from the fields above (the scheduler passes its
    # request's, worked out once)
    argmax_from: int | None = None
    # issue 32: an Embed request's pooling progress (model/pooling.py); None: not an embed
    embed: PoolProgress | None = None

    def __post_init__(self) -> None:
        if self.argmax_from is None:
            self.argmax_from = (
                ARGMAX_NEVER if (self.grammar is not None or self.return_hidden_states
                                 or self.logprob_start_len >= 0)
                else self.sampling.argmax_from(self.return_logprob or self.top_logprobs_num > 0))


@dataclass(slots=True)
class SeqOutput:
    """The token sampled for one sequence, with its logprobs when asked for.

    ``error`` set: this sequence failed on its own (its sampling parameters left no token:
    ``error_code`` INVALID_ARGUMENT; sampling raised: INTERNAL); ``token_id`` is then
    meaningless and the request must end with that error.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    error_code: str | None = None
    # see model/output_extras.py; token_id is meaningless on a sequence that did not sample
    input_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None
    token_ids_logprobs: list[tuple[int, float]] | None = None
    hidden_state: list[float] | None = None
    embedding: list[float] | None = None  # an Embed request's vector, at its last chunk


@dataclass(frozen=True, slots=True)
class ForwardTimes:
    """Seconds of one forward_step spent in the model (forward + logits) and in sampling."""

    model: float = 0.0
    sample: float = 0.0


class InvalidSequence(ValueError):
    """A sequence of a batch is invalid; ``index`` says which (nothing was run)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else as torch understands it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """"auto" -> float32 on CPU; on CUDA the checkpoint's half dtype, else bfloat16."""
    if dtype != "auto":
        return dtype_from_name(dtype)
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return dtype_from_name(checkpoint_dtype)
    return torch.bfloat16


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
        is_embedding: bool = False,
    ) -> None:
        if model_path is None:
            from sglang_admin.model.default_model import ensure_default_model

            model_path = ensure_default_model()
        self.device = resolve_device(device)
        probe = load_model_info(model_path, context_length)
        self.dtype = resolve_dtype(dtype, self.device, probe.dtype)
        self.model: LlamaForCausalLM
        self.model, self.info = load_model(
            model_path, dtype=self.dtype, device=self.device, context_length=context_length,
            is_embedding=is_embedding,
        )
        self.weight_bytes = self.info.weight_bytes
        self.context_length = self.info.context_length
        self.max_running_requests = max_running_requests
        # LoRA adapter slots (count, max rank), allocated before the KV pool is sized
        self.lora: LoraBuffers | None = None
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
            max_total_tokens = self._default_token_capacity(per_token)
        if max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be positive, got {max_total_tokens}")
        self.token_capacity = max_total_tokens
        self.kv_cache_bytes = (max_total_tokens + 1) * per_token
        self._kv: torch.Tensor | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self._allocate_kv()
        # CPU: the table is written from Python and the step's index tensors are views of
        # one persistent buffer (model/host_index.py); CUDA copies them to the device
        self._table_words: memoryview | None = None
        self._staging: StagingBuffer | None = None
        if self.device.type == "cpu":
            self.req_to_token, self._table_words = host_table(max_running_requests,
                                                              self.context_length)
            self._staging = StagingBuffer()
        else:
            self.req_to_token = torch.zeros(
                max_running_requests, self.context_length, dtype=torch.int64, device=self.device
            )
        self._arange = torch.arange(self.context_length, device=self.device)
        self._table_dirty = False  # written since the last reset (a flush of an idle pool skips it)
        # CPU only: persistent scratch for gathered K/V rows (CUDA's caching allocator
        # already reuses memory; on CPU fresh multi-megabyte buffers cost page faults)
        self._scratch: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # one per lane
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # CPU: a step's sequences are cut into this many lanes, each computed by a thread of
        # its own (threads that block when done, unlike OpenMP's, which spin: see
        # _split_lanes); CUDA and LoRA run one lane
        self.lanes = max(1, lanes) if self.device.type == "cpu" else 1
        self._lane_pool: ThreadPoolExecutor | None = None
        # CPU float32: decode attention read in place from the pool; RMSNorm, RoPE and
        # SwiGLU in one pass each (model/cpu_kernels.py)
        self.cpu_kernels = self._cpu_kernels(attention_backend)
        self.model.use_cpu_kernels(self.cpu_kernels)
        # whether prefill chunks may go through the kernel (this build, this head size)
        self._extend_kernel = (self.cpu_kernels is not None
                               and self.cpu_kernels.extend_applies(self.model.config.head_dim))
        self._score_scratch: list[torch.Tensor | None] = []  # one per lane
        self.last_times = ForwardTimes()  # the last forward_step's split, for step_timing
        logger.info(
            "model %s loaded: %s on %s, %.1f MiB weights, KV pool %d tokens (%.1f MiB)",
            self.info.architectures, self.info.dtype, self.device, self.weight_bytes / 2**20,
            self.token_capacity, self.kv_cache_bytes / 2**20,
        )

    def _cpu_kernels(self, backend: str) -> CpuKernels | None:
        """``auto``: the CPU kernels where they apply (float32 on CPU) and build;
        ``torch_native``: never; ``cpu_paged``: required (ModelLoadError otherwise)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if backend == "torch_native":
            return None
        applies = self.device.type == "cpu" and self.dtype == torch.float32
        kernel = load_cpu_kernels() if applies else None
        if backend == "cpu_paged" and kernel is None:
            raise ModelLoadError(
                "attention backend cpu_paged needs float32 on CPU and a C compiler that "
                "builds model/csrc/cpu_kernels.c (see the log); use auto or torch_native")
        if kernel is not None:
            logger.info("CPU kernels: %s", kernel.path)
        return kernel

    def _scores_scratch(self, lane: int, length: int) -> torch.Tensor:
        """Lane ``lane``'s scratch for the decode kernel's scores (grown, never shrunk)."""
        while len(self._score_scratch) <= lane:
            self._score_scratch.append(None)
        need = self.model.config.num_heads * length
        have = self._score_scratch[lane]
        if have is None or have.numel() < need:
            have = torch.empty(max(need, 2 * (have.numel() if have is not None else 0)))
            self._score_scratch[lane] = have
        return have

    def _default_token_capacity(self, per_token: int) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85) - (1 << 30)  # keep 1 GiB for activations
            tokens = budget // per_token
            if tokens <= 0:
                raise ModelLoadError("not enough free GPU memory for a KV cache")
            return int(tokens)
        return int(min(_CPU_MAX_TOKENS, _CPU_KV_BUDGET_BYTES // per_token))

    def _gather_scratch(self, lane: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lane ``lane``'s scratch for gathered K and V rows, at least ``rows`` rows (grown,
        never shrunk)."""
        while len(self._scratch) <= lane:
            self._scratch.append(None)
        have = self._scratch[lane]
        if have is None or have[0].shape[0] < rows:
            cfg = self.model.config
            cap = max(rows, 2 * have[0].shape[0] if have is not None else 0)
            shape = (cap, cfg.num_kv_heads * cfg.head_dim)
            have = (torch.empty(shape, dtype=self.dtype, device=self.device),
                    torch.empty(shape, dtype=self.dtype, device=self.device))
            self._scratch[lane] = have
        return have

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
        self._scratch = []
        self.reset()
        _return_memory(self.device)
        return self.kv_cache_bytes

    def resume_kv_cache(self) -> None:
        """Allocate the KV pool again (zeros); no-op when it is there."""
        if self._kv is None:
            self._allocate_kv()

    def release_weights(self) -> int:
        """Free every parameter (shapes kept); bytes released. Load weights after resuming."""
        if self.weights_released:
            return 0
        self.model.release_parameters()
        _return_memory(self.device)
        return self.weight_bytes

    def resume_weights(self) -> None:
        """Storage for the weights again, uninitialised: the caller loads weights next."""
        if self.weights_released:
            self.model.allocate_parameters(self.device)

    def reset(self) -> None:
        """Forget every sequence's slots (cache flush); the KV tensors are left as they are."""
        if self._table_dirty:
            self.req_to_token.zero_()
            self._table_dirty = False

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

    def _check(self, seqs: list[SeqInput], s: SeqInput) -> None:
        """:meth:`_validate` s; InvalidSequence (with s's index in seqs) when it fails."""
        try:
            self._validate(s)
        except ValueError as exc:
            index = next(i for i, x in enumerate(seqs) if x is s)
            raise InvalidSequence(index, str(exc)) from None

    def _validate(self, s: SeqInput) -> None:
        n = len(s.token_ids)
        if n == 0:
            raise ValueError("a sequence with no new tokens")
        if not 0 <= s.req_idx < self.max_running_requests:
            raise ValueError(f"req_idx {s.req_idx} out of range [0, {self.max_running_requests})")
        if s.prefix_len < 0 or s.prefix_len + n > self.context_length:
            raise ValueError(
                f"sequence length {s.prefix_len + n} exceeds context length {self.context_length}"
            )
        if s.table_slots:
            if s.table_start < 0 or s.table_start + len(s.table_slots) > self.context_length:
                raise ValueError("table_slots do not fit the request-to-token row")
            if min(s.table_slots) < 0 or max(s.table_slots) > self.token_capacity:
                raise ValueError(f"a KV slot outside [0, {self.token_capacity}]")

    def _forward_step(self, seqs: list[SeqInput], decode: list[SeqInput],
                      extend: list[SeqInput]) -> list[SeqOutput | None]:
        rows, ctx, capacity = self.max_running_requests, self.context_length, self.token_capacity
        # torch's attention pads a group of decode sequences to its longest: shortest first
        if self.cpu_kernels is None:
            decode.sort(key=lambda s: s.prefix_len)
        ordered = decode + extend
        nd = len(decode)

        # ---- host-side index lists, shipped to the device in one tensor; each sequence is
        # checked as it is read (InvalidSequence, before any device work)
        input_ids: list[int] = []
        positions: list[int] = []
        token_cells: list[int] = []  # req_idx * ctx + position of every new token
        table_cells: list[int] = []
        table_vals: list[int] = []
        select: list[int] = []  # flat index of the token whose logits are sampled
        sampled: list[SeqInput] = []
        offsets: list[int] = []  # flat index of each ordered sequence's first token
        offset = 0
        for s in ordered:
            n = len(s.token_ids)
            p = s.prefix_len
            base = s.req_idx * ctx
            slots = s.table_slots
            if n == 1:  # a decode sequence: one of each (most sequences of most steps)
                # _validate's checks inline, for a decode sequence with at most its own slot
                if not (0 <= s.req_idx < rows and 0 < p < ctx
                        and (not slots or (len(slots) == 1 and 0 <= slots[0] <= capacity
                                           and 0 <= s.table_start < ctx))):
                    self._check(seqs, s)
                input_ids.append(s.token_ids[0])
                positions.append(p)
                token_cells.append(base + p)
                if len(slots) == 1:
                    table_cells.append(base + s.table_start)
                    table_vals.append(slots[0])
                    slots = None
            else:
                self._check(seqs, s)
                input_ids.extend(s.token_ids)
                positions.extend(range(p, p + n))
                token_cells.extend(range(base + p, base + p + n))
            if slots:
                start = base + s.table_start
                table_cells.extend(range(start, start + len(slots)))
                table_vals.extend(slots)
            offsets.append(offset)
            offset += n
            if s.sample:
                select.append(offset - 1)
                sampled.append(s)
        offsets.append(offset)  # the end of the last sequence
        dec_rows = [s.req_idx for s in decode]
        dec_lens = [s.prefix_len + 1 for s in decode]
        ext_len = max((s.prefix_len + len(s.token_ids) for s in extend), default=0)
        # the sliding window only matters once some query sits at or past it
        window = self.sliding_window
        if window is not None and max(ext_len, max(dec_lens, default=0)) <= window:
            window = None
        parts = [input_ids, positions, token_cells, table_cells, table_vals, select,
                 dec_rows, dec_lens]
        if self._staging is not None:
            (t_ids, t_pos, t_cells, t_tcells, t_tvals, t_select, t_dec_rows,
             t_dec_lens) = self._staging.load(parts)
        else:
            flat: list[int] = []
            for part in parts:
                flat.extend(part)
            # from an int64 array: a fifth of torch.tensor's cost for a list of Python ints
            packed = torch.frombuffer(array("q", flat), dtype=torch.int64)
            (t_ids, t_pos, t_cells, t_tcells, t_tvals, t_select, t_dec_rows,
             t_dec_lens) = packed.to(self.device, non_blocking=True).split(
                 [len(part) for part in parts])
        # a decode step: every new token's slot is the one just written to its table cell
        # (no lookup in the table)
        slots_written = t_tvals if table_cells == token_cells else None
        if table_cells:
            words = self._table_words
            if words is not None:
                for cell, slot in zip(table_cells, table_vals):
                    words[cell] = slot
            else:
                self.req_to_token.view(-1).index_copy_(0, t_tcells, t_tvals)
            self._table_dirty = True

        # ---- attention metadata per lane, once for all layers
        lanes = self._split_lanes(ordered) if self.lora is None else [(0, len(ordered))]
        if len(lanes) == 1:  # the whole step (every decode step): no slicing
            metas = [self._metadata(extend, t_cells, slots_written, t_dec_rows, t_dec_lens,
                                    dec_lens, window, 0)]
        else:
            metas = []
            for i, (a, b) in enumerate(lanes):
                da, db = min(a, nd), min(b, nd)  # the lane's decode sequences
                metas.append(self._metadata(
                    ordered[max(a, nd) : b], t_cells[offsets[a] : offsets[b]],
                    None if slots_written is None else slots_written[offsets[a] : offsets[b]],
                    t_dec_rows[da:db], t_dec_lens[da:db], dec_lens[da:db], window, i))
        if self.lora is not None:  # which adapter each token runs with
            self.lora.prepare([s.lora_slot for s in ordered for _ in range(len(s.token_ids))])

        t_model = time.perf_counter()
        hidden = self._run_lanes(lanes, offsets, t_ids, t_pos, metas)
        if not sampled:
            self.last_times = ForwardTimes(model=time.perf_counter() - t_model)
            return self._with_extras({}, seqs, [], ordered, offsets, hidden, t_select)
        every_row = len(select) == offset  # one token per sequence, all sampled
        sampled_hidden = hidden if every_row else hidden.index_select(0, t_select)
        logits = self.model.compute_logits(sampled_hidden)
        if self.device.type == "cuda":  # sampling reads the tokens back anyway: no loss
            torch.cuda.synchronize(self.device)
        t_sample = time.perf_counter()
        if all([len(s.output_ids) >= s.argmax_from for s in sampled]):
            # sample()'s answer, without building its requests
            tokens = (self.cpu_kernels.argmax(logits)
                      if self.cpu_kernels is not None and logits.is_contiguous()
                      else logits.argmax(dim=-1).tolist())
            outs = [SeqOutput(token) for token in tokens]
            self.last_times = ForwardTimes(model=t_sample - t_model,
                                           sample=time.perf_counter() - t_sample)
            if len(sampled) == len(seqs) and all(map(operator.is_, sampled, seqs)):
                return outs  # type: ignore[return-value]  # all sampled, in order: decode
            by_seq = {id(s): out for s, out in zip(sampled, outs)}
            return self._with_extras(by_seq, seqs, sampled, ordered, offsets, hidden, t_select)
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
        self.last_times = ForwardTimes(model=t_sample - t_model,
                                       sample=time.perf_counter() - t_sample)
        return self._with_extras(by_seq, seqs, sampled, ordered, offsets, hidden, t_select)

    def _split_lanes(self, ordered: list[SeqInput]) -> list[tuple[int, int]]:
        """The ordered sequences cut into lanes (model/lanes.py's ``lane_cuts``); one run when
        lanes are off or the step is decode only: each half of a split decode step streams all
        the weights and pays the step's fixed cost again, and the second lane shares its core
        with the server's messages; served, that was slower than one lane
        (docs/benchmarks.md)."""
        if self.lanes <= 1 or len(ordered) < 2 or len(ordered[-1].token_ids) == 1:
            return [(0, len(ordered))]  # decode only (extend sequences come last)
        return lane_cuts([(len(s.token_ids), s.prefix_len) for s in ordered], self.lanes)

    def _metadata(self, extend: list[SeqInput], cells: torch.Tensor,
                  out_slots: torch.Tensor | None, dec_rows: torch.Tensor,
                  t_dec_lens: torch.Tensor, dec_lens: list[int], window: int | None,
                  lane: int) -> AttentionMetadata:
        """The attention metadata of one lane: its decode sequences (their table rows and
        lengths) first, then its extend sequences; ``cells`` are its new tokens' table cells,
        ``out_slots`` their pool slots when the caller knows them (else read from the table)."""
        table = self.req_to_token
        if out_slots is None:
            out_slots = table.view(-1).index_select(0, cells)
        meta = AttentionMetadata(out_slots=out_slots)
        nd = len(dec_lens)
        meta.num_decode = nd
        gathered = 0  # the most pool rows one group or extend sequence gathers
        if self.cpu_kernels is not None and nd:  # the kernel reads the table itself
            longest = max(dec_lens)
            meta.decode_batch = DecodeBatch(self.cpu_kernels, table, dec_rows, t_dec_lens,
                                            longest, self._scores_scratch(lane, longest))
        groups = group_by_length(dec_lens) if self.cpu_kernels is None else []
        for a, b in groups:
            length = dec_lens[b - 1]  # the lengths are ascending (sorted for torch's path)
            group = DecodeGroup(a, b - a, length,
                                table[:, :length].index_select(0, dec_rows[a:b]).reshape(-1))
            keys = self._arange[:length].unsqueeze(0)
            lens = t_dec_lens[a:b].unsqueeze(1)
            if dec_lens[a] != length:
                group.mask = (keys < lens).view(b - a, 1, 1, length)
            if window is not None:
                swa = (keys < lens) & (keys >= lens - window)
                group.swa_mask = swa.view(b - a, 1, 1, length)
            meta.decode_groups.append(group)
            gathered = max(gathered, (b - a) * length)
        # each extend sequence attends on its own, unpadded (see ExtendSeq); through the
        # prefill kernel (one thread, reading the pool through the table) where it is faster
        # than torch's: chunks up to EXTEND_MAX_TOKENS, and torch on one thread as well
        kernel_extend = self._extend_kernel and torch.get_num_threads() == 1
        start = 0
        for s in extend:
            p, n = s.prefix_len, len(s.token_ids)
            seq = ExtendSeq(start, n)
            meta.extend_seqs.append(seq)
            start += n
            if kernel_extend and n <= EXTEND_MAX_TOKENS:  # no masks or gathers to build
                seq.slots, seq.prefix = table[s.req_idx, : p + n], p
                continue
            in_window = window is not None and p + n > window
            if p or in_window:
                qpos = self._arange[p : p + n].unsqueeze(1)  # [n, 1]
                keys = self._arange[: p + n].unsqueeze(0)
                causal = keys <= qpos
                if p:
                    seq.kv_index = table[s.req_idx, : p + n]
                    seq.mask = causal.view(1, 1, n, p + n)
                    gathered = max(gathered, p + n)
                if in_window:
                    seq.swa_mask = (causal & (keys > qpos - window)).view(1, 1, n, p + n)
        if self.device.type == "cpu" and gathered:
            meta.gather_k, meta.gather_v = self._gather_scratch(lane, gathered)
        return meta

    def _run_lanes(self, lanes: list[tuple[int, int]], offsets: list[int], ids: torch.Tensor,
                   positions: torch.Tensor, metas: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states of every new token: one forward per lane, lanes past the first on
        the lane threads while this thread computes the first; joined in token order."""
        def run(i: int) -> torch.Tensor:
            a, b = offsets[lanes[i][0]], offsets[lanes[i][1]]
            return self.model(ids[a:b], positions[a:b], metas[i], self.k_caches, self.v_caches)

        if len(lanes) == 1:
            return run(0)
        if self._lane_pool is None:
            # a new thread does not inherit torch's thread count: without this, each lane
            # would start an OpenMP team of the machine's size, whose threads spin
            self._lane_pool = ThreadPoolExecutor(
                self.lanes - 1, thread_name_prefix="lane",
                initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        futures = [self._lane_pool.submit(_in_inference_mode, run, i)
                   for i in range(1, len(lanes))]
        first = run(0)
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
                     sampled: list[SeqInput], ordered: list[SeqInput], offsets: list[int],
                     hidden: torch.Tensor, select: torch.Tensor) -> list[SeqOutput | None]:
        """The step's outputs in ``seqs`` order, with what some sequences asked for beside
        the token: hidden states of sampled rows and prompt logprobs (model/output_extras.py;
        a sequence that sampled nothing gets an output only for its prompt logprobs)."""
        if not self.info.is_generation:  # issue 32: Embed requests' vectors (model/pooling.py)
            self._pool(by_seq, ordered, offsets, hidden)
        if not any(s.return_hidden_states or s.logprob_start_len >= 0 for s in ordered):
            return [by_seq.get(id(s)) for s in seqs]
        if any(s.return_hidden_states for s in sampled):
            wanted = [s.return_hidden_states for s in sampled]
            for s, state in zip(sampled, hidden_rows(self.model, hidden, select, wanted)):
                by_seq[id(s)].hidden_state = state
        if any(s.logprob_start_len >= 0 for s in ordered):
            for key, entries in input_logprobs(self.model, hidden, ordered, offsets).items():
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
