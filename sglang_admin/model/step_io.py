"""The runner's step interface: one sequence's input, its output, and the error that names
an invalid sequence of a batch. No torch here: the scheduler's tests build these records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_admin.messages import ARGMAX_NEVER, SamplingParams

if TYPE_CHECKING:
    from sglang_admin.model.grammar_mask import TokenMatcher
    from sglang_admin.model.pooling import PoolProgress


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
    # an Embed request's pooling progress (model/pooling.py); None: not an embed
    embed: PoolProgress | None = None
    # speculative decoding: a verify sequence: token_ids is its last token then
    # these draft tokens; every position is sampled (scheduler/speculative/verify.py) and the output
    # carries the accepted run. None or empty: an ordinary sequence.
    draft: list[int] | None = None

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
    # see model/hidden_extras.py; token_id is meaningless on a sequence that did not sample
    input_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None
    token_ids_logprobs: list[tuple[int, float]] | None = None
    hidden_state: list[float] | None = None
    embedding: list[float] | None = None  # an Embed request's vector, at its last chunk
    # a verify sequence (SeqInput.draft): the tokens after token_id that the step also
    # gives, each with its own logprobs (accepted draft tokens, then the target's own)
    more: list[SeqOutput] | None = None


class InvalidSequence(ValueError):
    """A sequence of a batch is invalid; ``index`` says which (nothing was run)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
