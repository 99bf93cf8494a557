"""The runner's memory: the dtype it runs in, its KV pool allocated, released and resumed,
its weights released and resumed, and freed memory handed back to the system."""

from __future__ import annotations

import ctypes
import gc
import math
import mmap

import torch

from sglang_admin.model.cpu_dtype import choose_dtype
from sglang_admin.model.loader import ModelLoadError

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str,
                  gguf_weight_type: str = "") -> torch.dtype:
    """"auto" -> model/cpu_dtype.py's rule (on CPU bfloat16 for half-precision or quantized
    weights on a CPU with native bfloat16, else float32; on CUDA the checkpoint's half dtype,
    else bfloat16)."""
    return choose_dtype(dtype, device, checkpoint_dtype, gguf_weight_type).dtype


class ResumeOutOfMemory(RuntimeError):
    """Resuming released memory ran out of it; that memory stays released."""

    def __init__(self, tag: str, nbytes: int, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"resuming {tag} ({nbytes / 2**30:.2f} GiB) ran out of memory: {first}; "
                         f"{tag} stays released: free memory on the device, then resume again")
        self.tag = tag


class RunnerMemory:
    """ModelRunner's memory occupation (mixed into it: the attributes are the runner's)."""

    def _allocate_kv(self) -> None:
        """The KV pool: one allocation; per-layer K and V are contiguous views of it."""
        cfg = self.model.config
        shape = (cfg.num_layers, 2, self.token_capacity + 1, cfg.num_kv_heads, cfg.head_dim)
        self._kv = (zeroed_cpu_tensor(shape, self.dtype) if self.device.type == "cpu"
                    else torch.zeros(shape, dtype=self.dtype, device=self.device))
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
        return_memory(self.device)
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
                return_memory(self.device)
                raise ResumeOutOfMemory("kv_cache", self.kv_cache_bytes, exc) from None

    def release_weights(self) -> int:
        """Free every parameter (shapes kept; GGUF projections kept quantized too); bytes
        released. Load weights after resuming (model/weights.py's ``reload_weights``)."""
        if self.weights_released:
            return 0
        quant = getattr(self.model, "quant", None)
        if quant is not None:
            if quant.scheme != "gguf":
                raise ModelLoadError(f"weights quantized at load (--torchao-config "
                                     f"{quant.scheme}) cannot be released and reloaded yet; "
                                     "serve without it for that")
            if getattr(self.model, "tensor_parallel", None) is not None:
                raise ModelLoadError("GGUF weights kept quantized at --tp-size > 1 cannot be "
                                     "released and reloaded yet; serve with --gguf-dequantize "
                                     "for that")
            # an empty store of the same scheme: the kept projections are freed with the old
            # one, and the reload after resume (model/weights.py's reload_weights) reads them
            # from the GGUF file again
            from sglang_admin.model.quant import decode_step
            from sglang_admin.model.quant.store import QuantStore

            self.model.quant = QuantStore("released: reloaded from the GGUF file on resume")
            decode_step.forget_plans(self.model)
        if self.packed is not None:
            self.packed.clear()
        if self.graphs is not None:  # they point at the weights: captured again after resume
            self.graphs.drop()
        self.model.release_parameters()
        return_memory(self.device)
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
                return_memory(self.device)
                raise ResumeOutOfMemory("weights", self.weight_bytes, exc) from None

    def empty_cache(self) -> None:
        """Hand memory the allocator keeps cached back (CUDA's cached blocks; glibc's free
        arenas on CPU): the torch_empty_cache of ContinueGeneration and weight updates."""
        return_memory(self.device)


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in an anonymous mapping of its own: the kernel's zero pages, each
    touched only when first written, and unmapped when the tensor goes.

    ``torch.zeros`` writes every byte at start, through glibc's allocator, which the ranks
    tell to ask for huge pages (constants.rank_memory_environment): on a host whose memory
    is fragmented the kernel compacts memory before each huge page, which cost a rank 10 s
    of wall and 20 s of CPU for SmolLM2's 1.5 GB pool (its start: 19 s, now 3-5 s). The
    mapping asks for huge pages too (decode attention reads the pool; in ordinary pages
    served chat ran 5-10% slower), but each is made when first written: the first requests
    into fresh slots pay it (a 32-token prompt's TTFT ~4 ms more on the first touch)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages as the pool is written (Linux)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def keep_freed_cpu_memory() -> None:
    """Let glibc keep freed memory for the next step instead of giving it back at once.

    A forward pass allocates and frees megabytes of activations; by default glibc serves
    such blocks with mmap and unmaps them when freed, so every step pays page faults on
    fresh memory (a fifth of a CPU prefill step here: docs/benchmarks.md). Blocks up to
    32 MiB now come from the heap, which is trimmed past 1 GiB of free space; the memory
    release RPCs still hand everything back (``return_memory`` trims).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def return_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks, or glibc's arenas on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
