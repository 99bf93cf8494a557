"""The runner's outputs: the batch sampled at once (row by row when that raises, so only the
rows at fault fail), and what some sequences ask for beside the token: hidden states, prompt
logprobs, an Embed request's pooled vector."""

from __future__ import annotations

import logging

import torch

from sglang_admin.model.batch import ForwardBatch
from sglang_admin.model.hidden_extras import hidden_rows, input_logprobs
from sglang_admin.model.pooling import pool
from sglang_admin.model.sampling import SampleRequest, SampleResult, sample
from sglang_admin.model.step_io import SeqInput, SeqOutput

logger = logging.getLogger(__name__)


class RunnerOutputs:
    """ModelRunner's sampling and extras (mixed into it: the attributes are the runner's)."""

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
