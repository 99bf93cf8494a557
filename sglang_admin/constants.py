"""The constants and naming rules that the server and the scheduler ranks must agree on.

Kept here, free of torch and of the generated stubs, so that both processes import one
definition: the server (which never imports torch) and the ranks. The wire-level ones that
belong to a message (``GREEDY_TEMPERATURE_EPS`` and ``SamplingParams.argmax_from``, the greedy
rule; ``PROFILE_STOPPED_BY_ITSELF``; ``GRAMMAR_KINDS``) live beside those messages in
``sglang_admin/messages.py``, which both sides import as well.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- profiling

# What StartProfile records when the request names no activity (SGLang's default).
DEFAULT_PROFILE_ACTIVITIES = ("CPU", "GPU")
# Our stage names -> SGLang's ForwardMode names, used in per-stage file names.
PROFILE_STAGE_NAMES = {"prefill": "EXTEND", "decode": "DECODE"}


def profile_file_stem(profile_id: str, prefix: str) -> str:
    """What every file of a profile starts with: ``[{prefix}-]{profile_id}``."""
    return f"{prefix}-{profile_id}" if prefix else profile_id


def profile_file_base(profile_id: str, prefix: str, rank: int, dp_size: int,
                      tp_rank: int = 0) -> str:
    """File name base of one rank's files: ``[{prefix}-]{id}-TP-{tp_rank}[-DP-{rank}]``
    (SGLang's)."""
    return f"{profile_file_stem(profile_id, prefix)}-TP-{tp_rank}" + (
        f"-DP-{rank}" if dp_size > 1 else "")


# ----------------------------------------------------------------------------- weights

# ReleaseMemoryOccupation / ResumeMemoryOccupation tags (empty request: all of them).
MEMORY_TAGS = ("kv_cache", "weights")

# ----------------------------------------------------------------------------- LoRA

LORA_NOT_ENABLED = "LoRA is not enabled on this worker (start it with --enable-lora)"
# A LoRA request's radix-cache keys are ``token | namespace << LORA_NAMESPACE_SHIFT``: tokens
# are < 2**32 (uint32 on the wire), the adapter's cache namespace takes the bits above. The
# server's KV events split them again with the mask.
LORA_NAMESPACE_SHIFT = 32
LORA_TOKEN_MASK = (1 << LORA_NAMESPACE_SHIFT) - 1


# ------------------------------------------------------------------------------- threads

# The OpenMP settings a rank process starts with unless the user set either (read by the
# OpenMP runtime when the rank imports torch; docs/cpu-performance.md). A large model's GEMMs
# on CPU run on a team of OpenMP threads (model/runner.py), ~180 parallel regions a decode
# step. A team that sleeps at once when it waits (PASSIVE) pays a wake-up at each; one that
# spins without end (ACTIVE alone) or for libgomp's default ~300k spins (several ms) holds
# the core the server needs for the step's messages. Spinning ~10k times (a fraction of a
# millisecond) bridges the gaps inside a step and sleeps between steps: served SmolLM2-135M
# bfloat16 chat, quiet machine, 2 cores: 343-371 tok/s against 302-305 (PASSIVE), 314-323
# (3k spins) and 327-329 (30k spins).
RANK_OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}


def rank_openmp_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with RANK_OPENMP_DEFAULTS added where the user set neither variable."""
    if any(name in environ for name in RANK_OPENMP_DEFAULTS):
        return dict(environ)
    return dict(environ) | RANK_OPENMP_DEFAULTS


# glibc's malloc asks the kernel for transparent huge pages (madvise) for the memory it maps
# and its heap (glibc 2.35 and later; older ones ignore the name). Where the kernel's THP mode
# is ``madvise`` (a common default) a rank's weights and KV pool otherwise sit in 4 KiB pages:
# a bfloat16 decode step streams ~270 MB of packed weights and reads the KV pool's rows at
# scattered slots, one TLB miss per page. With 2 MiB pages (2-core Xeon, 1 thread, process
# CPU time): decode attention at 32 sequences of ~95 tokens 20-30% faster, an in-process
# SmolLM2 batch-32 decode step 3-10% (docs/cpu-performance.md).
RANK_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def rank_memory_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with RANK_MALLOC_TUNABLE added to GLIBC_TUNABLES (read by glibc when a
    rank process starts), unless the user's GLIBC_TUNABLES already sets ``hugetlb``."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return dict(environ)
    joined = f"{tunables}:{RANK_MALLOC_TUNABLE}" if tunables else RANK_MALLOC_TUNABLE
    return dict(environ) | {"GLIBC_TUNABLES": joined}
