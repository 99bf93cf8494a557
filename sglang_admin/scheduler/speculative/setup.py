"""Speculative decoding at a rank's start: its settings from the server's arguments, and
STANDALONE's draft model loaded beside the target."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang_admin.config import ServerArgs
from sglang_admin.scheduler.speculative.policy import DEFAULT_DRAFT_TOKENS, SpecConfig, check_config

if TYPE_CHECKING:
    from sglang_admin.model.runner import ModelRunner
    from sglang_admin.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def spec_config(args: ServerArgs) -> SpecConfig | None:
    """The rank's speculative settings; None when off. ValueError (the rank does
    not start) on settings the CLI would have refused."""
    if args.speculative_algorithm is None:
        return None
    refusal = check_config(args.speculative_algorithm, args.speculative_num_draft_tokens,
                           args.speculative_ngram_min_match_window_size,
                           args.speculative_ngram_max_match_window_size,
                           args.speculative_draft_model_path)
    if refusal is not None:
        raise ValueError(refusal)
    return SpecConfig(
        args.speculative_algorithm,
        args.speculative_num_draft_tokens or DEFAULT_DRAFT_TOKENS,
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
    )


def install_draft_model(args: ServerArgs, target: ModelRunner, scheduler: Scheduler
                        ) -> ModelRunner | None:
    """STANDALONE: load the draft model beside the target (this rank only; TP
    followers never draft) and make the scheduler draft with it; its runner, or None when
    the rank drafts otherwise. Its table has a row per running request; its pool holds
    the target's capacity plus a full draft per row (a request that finds no room drafts
    nothing that step)."""
    spec = scheduler.config.speculative
    if spec is None or spec.algorithm != "STANDALONE":
        return None
    from sglang_admin.scheduler.speculative.draft_drafter import DraftModelDrafter
    from sglang_admin.scheduler.speculative.draft_model import load_draft_runner

    assert args.speculative_draft_model_path is not None  # spec_config checked it
    rows = args.max_running_requests
    capacity = min(target.token_capacity + rows * (spec.num_draft_tokens + 1),
                   rows * target.context_length)
    draft = load_draft_runner(args.speculative_draft_model_path, target, rows, capacity,
                              args.attention_backend)
    scheduler.drafter = DraftModelDrafter(draft.forward_step, rows, draft.token_capacity,
                                          lambda: scheduler.running)
    logger.info("STANDALONE drafts with %s (%d KV tokens)", draft.info.model_path,
                draft.token_capacity)
    return draft
