"""Parallel sampling (``n > 1``): one prompt, n samples, one prefill.

The scheduler queues the n samples of a request as n rank-side requests. Sample 0 (the
*parent*) is admitted first and prefills the prompt; its prefilled KV goes into the radix
cache as soon as its prefill completes (kv_memory.py's ``RequestMemory.share_prefilled``).
The other samples wait in the queue until then and are admitted with the prompt's KV
matched from the cache:
each computes only the prompt's last token (to sample its own first token) and from there
on decodes on its own, with its own output, penalties and logprobs. Without a radix cache
(``SchedulerConfig.disable_radix_cache``) nothing can be shared: the samples prefill
independently.
"""

from __future__ import annotations

from typing import Protocol


def sample_key(rid: str, index: int) -> str:
    """The rank-side key of sample ``index`` of request ``rid`` (sample 0 keeps ``rid``)."""
    return rid if index == 0 else f"{rid}#{index}"


class _Sample(Protocol):
    prompt_ids: list[int]
    kv_len: int
    done: bool
    fork_of: _Sample | None


def fork_ready(req: _Sample, sharing: bool) -> bool:
    """May this sample be admitted now? Sample 0 always; a forked sample once its parent's
    prompt KV is computed (and so in the radix cache), or once the parent ended (its KV was
    handed to the cache then). Without sharing (no radix cache) at once."""
    parent = req.fork_of
    if parent is None or not sharing:
        return True
    return parent.done or parent.kv_len >= len(parent.prompt_ids)
