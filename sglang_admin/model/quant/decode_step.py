"""A bfloat16 decode step whose projections are kept quantized, all its decoder layers in one
C call (``csrc/quant_decode.c``): steps of a few rows (batch 1 and 2) through the few-row
kernel, and steps of ``amx.MIN_ROWS``-``amx.MAX_ROWS`` rows (batched decode) through the
AMX kernel.

What it replaces: :meth:`LlamaForCausalLM.decode_bf16` with the projections through those
kernels (model/quant/gemv.py, model/quant/amx.py), a Python loop of about nine ctypes calls
and a few tensors a layer: about 2 ms of CPU a token of SmolLM2-135M's ~10 at batch 1, and
at 32 rows ~3 ms of a step that ran on one thread while the rest of the OpenMP team waited
(docs/cpu-performance.md). The C function calls the same kernels (csrc/cpu_kernels.c's
bfloat16 norms, RoPE + K/V write + attention and SwiGLU; csrc/quant_gemv.c's or
csrc/quant_amx.c's projections) in the same order on the same values, so the hidden states
are the same bits as that loop's.

Steps of a few rows run in one OpenMP parallel region (``q4_decode_team``: each projection's
blocks split over the team, each thread its own copy of the small per-row vectors), and so
do batched steps on a team of threads (``q4_decode_amx_team``, csrc/quant_decode_amx.c: the
projections' blocks, the sequences' attention and SwiGLU split over the team, barriers
between the phases; on one thread ``q4_decode_layers``). A few-row step computes, where
every row samples (``meta.want_logits``), the final norm and a Q8_0 LM head's float32
logits in the same call (``meta.logits``: what ``QuantLinear.exact_logits`` computes); the
few-row layouts are moved into one buffer on transparent huge pages when planned
(model/quant/hugepages.py). docs/cpu-performance.md has the measurements.

It serves a step where every layer's four projections are kept in the kernel's layouts
(few-row: int4 groups of 32 or Q8_0 blocks; AMX: int4 groups of 32; no bias, no
tensor-parallel sum), the layer has no LoRA and no per-head q/k norms
(``DecoderLayer.decodes_in_bf16_kernels``), and the step has at most ``GEMV_MAX_ROWS`` rows
(model/quant/linear.py) or is in the AMX kernel's rows. Anywhere else (a CPU without
AVX512_VNNI/AVX512_BF16 or without AMX, where the kernels have no layouts; a compiler that
cannot build it; steps of 3-4 rows, torch's int4 kernel's) :func:`run` returns None and the
caller's loop serves.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_admin.model.quant import amx, gemv, hugepages
from sglang_admin.model.quant import linear as quant_linear
from sglang_admin.model.quant.linear import QuantLinear

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# joined in this order into one translation unit (quant_decode.c calls the others' functions)
SOURCES = ("cpu_kernels.c", "quant_gemv.c", "quant_amx.c", "quant_decode.c",
           "quant_decode_amx.c")
# where a model keeps its plans, (weakref to the store, StepPlan | None): few rows, AMX rows
PLAN_KEYS = ("_quant_step_plan", "_quant_step_plan_amx")
KINDS = {"int4": 0, "int8x32": 1}  # the few-row kernel's layouts
AMX_INT4 = 2  # int4 in the AMX kernel's layout
PTRS = 12  # pointers a layer (quant_decode.c's DL_PTRS)

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class DecodeStepKernel:
    """The built library: :meth:`run` of a prepared :class:`StepPlan`."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self.applies = bool(lib.q4_decode_applies())
        # the AMX projections: built for tiles, and Linux grants this process their state
        self.amx = bool(lib.amx_applies()) and lib.amx_init() == 0
        self._scratch = lib.q4_decode_scratch
        self._scratch.restype = _I64
        self._scratch.argtypes = [_I64] * 6
        self._layers = lib.q4_decode_layers
        self._layers.restype = None
        self._layers.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32,
                                 _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR,
                                 _PTR, _I64, _PTR, _PTR]
        self._team_scratch = lib.q4_decode_team_scratch
        self._team_scratch.restype = _I64
        self._team_scratch.argtypes = [_I64] * 7
        self._team = lib.q4_decode_team
        self._team.restype = None
        self._team.argtypes = self._layers.argtypes[:-1] + [_I64, _PTR, _PTR, _PTR, _PTR,
                                                            _I64, _PTR]
        self.amx_team = bool(lib.q4_decode_amx_team_applies())
        self._amx_team_scratch = lib.q4_decode_amx_team_scratch
        self._amx_team_scratch.restype = _I64
        self._amx_team_scratch.argtypes = [_I64] * 8
        self._amx_team = lib.q4_decode_amx_team
        self._amx_team.restype = None
        args = self._layers.argtypes
        # as q4_decode_layers' but for kinds, scores_len and f32; scratch bytes, threads
        self._amx_team.argtypes = args[:11] + args[12:21] + [_PTR, _I64]

    def scratch_elements(self, rows: int, hidden: int, inter: int, heads: int, kv_heads: int,
                         head_dim: int) -> int:
        """bfloat16 scratch elements a step of ``rows`` needs."""
        return int(self._scratch(rows, hidden, inter, heads, kv_heads, head_dim))


@dataclass
class StepPlan:
    """A model's layers as the C step reads them, built once (:func:`build_plan`)."""

    # weak references, so that a plan keeps no weight alive (a release of the weights frees
    # them): 4 projections a layer, whose layouts ``ptrs`` points at; each one's gemv_w at
    # build (a change: build again); the 2 norms' weights a layer and their modules
    projections: list[weakref.ref]
    layouts: list[weakref.ref]
    norms: list[weakref.ref]
    norm_modules: list[weakref.ref]
    kinds: torch.Tensor  # int32 [L, 4]
    windows: torch.Tensor  # int64 [L]
    ptrs: torch.Tensor  # int64 [L, PTRS] (K / V pools filled per step)
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    widest: int  # the largest projection's N (Q8_0's float32 scratch)
    any_q8: bool
    pools: list[int] | None = None  # the K / V pools' addresses ``ptrs`` holds
    layout: str = "gemv_w"  # the projections' attribute ``layouts`` was taken from
    # the final norm's weight and a Q8_0 LM head's layout and scales (few-row steps; their
    # owners are the last entries of ``norm_modules`` / ``projections``), or None
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    vocab: int = 0  # the head's rows

    def current(self) -> bool:
        """Whether the projections and norms still hold the tensors the pointers were taken
        from."""
        for owner, held, attr in ((self.projections, self.layouts, self.layout),
                                  (self.norm_modules, self.norms, "weight")):
            for o, t in zip(owner, held):
                obj, tensor = o(), t()
                if obj is None or tensor is None or getattr(obj, attr) is not tensor:
                    return False
        return True


def _combined_source() -> Path:
    """The three sources joined into one file named by their content (built once)."""
    text = "".join(f'#line 1 "{name}"\n' + (CSRC / name).read_text() + "\n" for name in SOURCES)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    from sglang_admin.model.cpu_kernels_build import _cache_dir

    target = _cache_dir() / f"quant_decode_src-{digest}.c"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".c", dir=target.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, target)  # atomic: ranks writing at once each land a whole file
    return target


def load(use_amx: bool = False) -> DecodeStepKernel | None:
    """The library where the few-row kernel serves (AVX512_VNNI + AVX512_BF16) and it builds,
    (``use_amx``) with the AMX kernel serving too; else None (logged)."""
    if gemv.gemv_kernel() is None:
        return None
    if use_amx:
        kernel = _load() if amx.amx_kernel() is not None else None
        return kernel if kernel is not None and kernel.amx else None
    return _load()


@functools.cache
def _load() -> DecodeStepKernel | None:
    from sglang_admin.model.cpu_kernels_build import _FLAG_SETS, _compile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cflags, libs = _FLAG_SETS[0]
    try:
        path = _compile(cc, cflags, libs, source=_combined_source())
        kernel = DecodeStepKernel(path) if path is not None else None
    except OSError as exc:
        logger.warning("quantized decode step: could not load it: %s", exc)
        return None
    if kernel is None or not kernel.applies:
        logger.info("quantized decode step: not built for this CPU; the layer loop serves")
        return None
    return kernel


def _projection(quant: Any, weight: torch.Tensor | None, bias: torch.Tensor | None,
                use_amx: bool = False) -> QuantLinear | None:
    if weight is None or bias is not None:
        return None
    p = quant.find(weight)
    if not isinstance(p, QuantLinear) or p.dtype != torch.bfloat16:
        return None
    if use_amx:
        has = p.kind == "int4" and p.amx_codes is not None and p.amx_sz is not None
    else:
        has = p.kind in KINDS and p.gemv_w is not None and p.gemv_s is not None
    return p if has else None


def _layouts(p: QuantLinear, use_amx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight and its scales the C step reads."""
    w, s = (p.amx_codes, p.amx_sz) if use_amx else (p.gemv_w, p.gemv_s)
    assert w is not None and s is not None
    return w, s


def build_plan(model: Any, use_amx: bool = False) -> StepPlan | None:
    """``model``'s layers for the C step (``use_amx``: its projections through the AMX
    kernel's layouts, else the few-row kernel's), or None where one of them does not fit
    it."""
    quant, layers = model.quant, model.model.layers
    if quant is None or quant._reduce is not None or not len(layers):
        return None
    first = layers[0].self_attn
    h, kv, d = first.num_heads, first.num_kv_heads, first.head_dim
    hidden = model.config.hidden_size
    inter = layers[0].mlp.down_proj.in_features
    eps = layers[0].input_layernorm.eps
    projections, norms, modules, kinds, windows = [], [], [], [], []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not layer.decodes_in_bf16_kernels():
            return None
        if ((attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
                != (h, kv, d, first.scale) or mlp.down_proj.in_features != inter
                or layer.input_layernorm.eps != eps
                or layer.post_attention_layernorm.eps != eps):
            return None
        parts = [_projection(quant, attn.qkv_weight, attn.qkv_bias, use_amx),
                 _projection(quant, attn.o_proj.weight, attn.o_proj.bias, use_amx),
                 _projection(quant, mlp.gate_up_weight, mlp.gate_up_bias, use_amx),
                 _projection(quant, mlp.down_proj.weight, mlp.down_proj.bias, use_amx)]
        shapes = [((h + 2 * kv) * d, hidden), (hidden, h * d), (2 * inter, hidden),
                  (hidden, inter)]
        if any(p is None or p.shape != s for p, s in zip(parts, shapes)):
            return None
        ln = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if any(w.dtype != torch.bfloat16 or not w.is_contiguous() or w.numel() != hidden
               for w in ln):
            return None
        projections += parts
        norms += ln
        modules += [layer.input_layernorm, layer.post_attention_layernorm]
        kinds.append([AMX_INT4 if use_amx else KINDS[p.kind] for p in parts])
        windows.append(attn.sliding_window or 0)
    head = None if use_amx else _head(model, eps)
    if head is not None:  # tracked as the layers' are (current())
        projections.append(head[0])
        norms.append(head[1].weight)
        modules.append(head[1])
    if not use_amx:
        _to_huge_pages(projections)
    ptrs = torch.zeros(len(layers), PTRS, dtype=torch.int64)
    for i in range(len(layers)):
        q, o, gu, down = (_layouts(p, use_amx) for p in projections[4 * i: 4 * i + 4])
        ptrs[i, :10] = torch.tensor([
            norms[2 * i].data_ptr(), q[0].data_ptr(), q[1].data_ptr(), o[0].data_ptr(),
            o[1].data_ptr(), norms[2 * i + 1].data_ptr(), gu[0].data_ptr(), gu[1].data_ptr(),
            down[0].data_ptr(), down[1].data_ptr()])
    layout = "amx_codes" if use_amx else "gemv_w"
    refs = [[weakref.ref(o) for o in objs]
            for objs in (projections, [getattr(p, layout) for p in projections], norms,
                         modules)]
    return StepPlan(*refs,
                    torch.tensor(kinds, dtype=torch.int32), torch.tensor(windows),
                    ptrs, hidden, inter, h, kv, d, eps, first.scale,
                    max(p.shape[0] for p in projections[: 4 * len(layers)]),
                    any(k == KINDS["int8x32"] for row in kinds for k in row), layout=layout,
                    head=None if head is None else (head[1].weight, *_layouts(head[0], False)),
                    vocab=0 if head is None else head[0].shape[0])


def _to_huge_pages(projections: list[QuantLinear]) -> None:
    """The projections' few-row layouts (the head's last) moved into one buffer on huge
    pages in the order a step reads them (model/quant/hugepages.py), where the kernel
    grants them and they are not there already."""
    tensors = [t for p in projections for t in (p.gemv_w, p.gemv_s) if t is not None]
    if len(tensors) != 2 * len(projections) or len(
            {t.untyped_storage().data_ptr() for t in tensors}) == 1:
        return
    views = hugepages.on_huge_pages(tensors)
    if views is None:
        return
    for i, p in enumerate(projections):
        p.gemv_w, p.gemv_s = views[2 * i], views[2 * i + 1]
    del tensors  # the layouts replaced: freed, and their memory handed back
    hugepages.return_freed()


def _head(model: Any, eps: float) -> tuple[QuantLinear, Any] | None:
    """The LM head where the few-row step computes it too (a Q8_0 head kept in the few-row
    layout, whose logits are exact: ``QuantLinear.exact_logits``; a final norm through the
    CPU kernels with the layers' eps), and the final norm; else None."""
    norm = model.model.norm
    head = _projection(model.quant, model.output_weight(), None)
    if (head is None or head.kind != "int8x32" or getattr(norm, "kernels", None) is None
            or norm.eps != eps or norm.weight.dtype != torch.bfloat16
            or not norm.weight.is_contiguous() or head.shape[1] != norm.weight.numel()):
        return None
    return head, norm


def plan_ahead(model: Any) -> None:
    """Make the few-row plan now (a model just loaded), so that the first decode step does
    not pay for it: moving the layouts onto huge pages takes 0.5-1.2 s for SmolLM2-135M's
    96 MB on this VM (the kernel compacting memory for each 2 MB page)."""
    if getattr(model, "quant", None) is not None and load() is not None:
        plan = build_plan(model)
        if plan is not None:  # else run() looks again at its first step, as before
            model.__dict__[PLAN_KEYS[0]] = (weakref.ref(model.quant), plan)


def forget_plans(model: Any) -> None:
    """Drop the model's step plans (made again at the next step): a plan holds the head's
    layouts, and with them the huge-page buffer of every layer's, which must go with the
    weights they were made from when those are released."""
    for key in PLAN_KEYS:
        model.__dict__.pop(key, None)


def run(model: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any,
        k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The decode step's layers on ``x`` [rows, hidden] (bfloat16, updated in place and
    returned), or None (nothing done) where the C step does not serve it."""
    rows = x.shape[0]
    batch = meta.decode_batch
    if rows <= quant_linear.GEMV_MAX_ROWS:
        use_amx, key = False, PLAN_KEYS[0]
    elif amx.MIN_ROWS <= rows <= amx.MAX_ROWS:
        use_amx, key = True, PLAN_KEYS[1]
    else:
        return None
    if batch is None or not x.is_contiguous():
        return None
    cached = model.__dict__.get(key)  # (weakref to the store, plan)
    if cached is None or cached[0]() is not model.quant or (
            cached[1] is not None and not cached[1].current()):
        # None: the layers do not fit it, or the library is not built
        cached = (weakref.ref(model.quant),
                  build_plan(model, use_amx) if load(use_amx) is not None else None)
        model.__dict__[key] = cached
    step: StepPlan | None = cached[1]
    if step is None:
        return None
    kernel = _load()  # built: load() said so when the plan was made (cached since)
    assert kernel is not None
    h, kv, d = step.heads, step.kv_heads, step.head_dim
    if not (cos.dtype == sin.dtype == torch.bfloat16 and cos.is_contiguous()
            and sin.is_contiguous() and cos.numel() == rows * d == sin.numel()
            and meta.out_slots.dtype == torch.int64 and meta.out_slots.is_contiguous()
            and meta.out_slots.numel() == rows and batch.rows.numel() == rows
            and batch.table.dtype == batch.rows.dtype == batch.lens.dtype == torch.int64
            and batch.table.is_contiguous() and batch.rows.is_contiguous()
            and batch.lens.is_contiguous() and len(k_caches) == len(v_caches) == len(
                step.windows)
            and batch.scores.numel() >= (h // kv) * batch.longest):
        return None
    pools = [c.data_ptr() for c in k_caches] + [c.data_ptr() for c in v_caches]
    if step.pools != pools:
        for c in (*k_caches, *v_caches):
            if not (c.dtype == torch.bfloat16 and c.is_contiguous() and c.dim() == 3
                    and c.shape[1:] == (kv, d)):
                return None
        step.ptrs[:, 10] = torch.tensor(pools[: len(k_caches)])
        step.ptrs[:, 11] = torch.tensor(pools[len(k_caches):])
        step.pools = pools
    f32 = (batch.buffer("quant_step_f32", rows, step.widest, torch.float32)
           if step.any_q8 else None)
    if not use_amx:  # every layer in one parallel region
        threads = torch.get_num_threads()
        scratch = batch.buffer("quant_step_team", 1, kernel._team_scratch(
            rows, step.hidden, step.inter, h, kv, d, threads) + 64, torch.uint8)
        base = scratch.data_ptr()
        head = step.head if meta.want_logits else None
        logits = None if head is None else torch.empty(rows, step.vocab, dtype=torch.float32)
        kernel._team(
            x.data_ptr(), rows, len(step.windows), step.hidden, step.inter, h, kv, d,
            step.eps, step.scale, step.ptrs.data_ptr(), step.kinds.data_ptr(),
            step.windows.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            meta.out_slots.data_ptr(), batch.table.data_ptr(), batch.table.shape[1],
            batch.rows.data_ptr(), batch.lens.data_ptr(), batch.scores.data_ptr(),
            batch.scores.numel(), base + (-base) % 64, threads,
            None if f32 is None else f32.data_ptr(),
            *((None, None, None, 0) if head is None else (
                head[0].data_ptr(), head[1].data_ptr(), head[2].data_ptr(), step.vocab)),
            None if logits is None else logits.data_ptr())
        meta.logits = logits
        return x
    threads = torch.get_num_threads()
    if kernel.amx_team and threads > 1 and step.inter % 16 == 0:  # one parallel region
        scratch = batch.buffer("quant_step_amx_team", 1, kernel._amx_team_scratch(
            rows, step.hidden, step.inter, h, kv, d, len(step.windows), threads) + 64,
            torch.uint8)
        base = scratch.data_ptr()
        kernel._amx_team(
            x.data_ptr(), rows, len(step.windows), step.hidden, step.inter, h, kv, d,
            step.eps, step.scale, step.ptrs.data_ptr(), step.windows.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), meta.out_slots.data_ptr(), batch.table.data_ptr(),
            batch.table.shape[1], batch.rows.data_ptr(), batch.lens.data_ptr(),
            batch.scores.data_ptr(), base + (-base) % 64, threads)
        return x
    scratch = batch.buffer("quant_step", 1, kernel.scratch_elements(
        rows, step.hidden, step.inter, h, kv, d), torch.bfloat16)
    kernel._layers(
        x.data_ptr(), rows, len(step.windows), step.hidden, step.inter, h, kv, d, step.eps,
        step.scale, step.ptrs.data_ptr(), step.kinds.data_ptr(), step.windows.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), meta.out_slots.data_ptr(), batch.table.data_ptr(),
        batch.table.shape[1], batch.rows.data_ptr(), batch.lens.data_ptr(),
        batch.scores.data_ptr(), batch.scores.numel(), scratch.data_ptr(),
        None if f32 is None else f32.data_ptr())
    return x
