"""STANDALONE speculative decoding: drafts from a small model of the target's
tokenizer. No torch here: the draft model is a step function over the runner's sequence
records (scheduler/speculative/draft_model.py builds it); this module keeps each request's draft KV.

Each drafting request owns one row of the draft model's request-to-token table and a
contiguous list of the draft pool's slots. Between steps the row's first ``valid``
positions hold the K/V of the request's verified sequence (prompt + output; sequences only
grow, so a prefix once computed stays right). A step extends the row by the tokens the
target gave since (the whole sequence the first time: the lazy prefill), whose last logits
give the first draft token, then decodes the rest of the draft one token at a time, every
drafting request batched in each of those forward steps. The draft tokens' K/V sit after
``valid`` and are overwritten by the next step (the row is rewound to the verified length),
so rejected drafts need no freeing. A request's row and slots go back when it leaves the
running set (it ended, was aborted, retracted or paused with retract) and on a flush.

Drafts are greedy (the draft model's argmax) for every request: a deterministic draft is a
point-mass draft distribution, which the target's verification keeps exact for sampled
requests too (scheduler/speculative/verify.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sglang_admin.messages import SamplingParams
from sglang_admin.model.step_io import SeqInput, SeqOutput
from sglang_admin.scheduler.kv_pool import TokenAllocator
from sglang_admin.scheduler.request import Req

logger = logging.getLogger(__name__)

DraftStep = Callable[[list[SeqInput]], list[SeqOutput | None]]
GREEDY = SamplingParams(temperature=0.0)


@dataclass(eq=False, slots=True)
class DraftRow:
    """One request's draft KV: its table row, its slots (position i -> slots[i]) and how
    many leading positions hold the K/V of its verified sequence."""

    req: Req
    row: int
    slots: list[int] = field(default_factory=list)
    valid: int = 0


class DraftModelDrafter:
    """The Drafter of STANDALONE (scheduler/speculative/policy.py's protocol) over a draft model's
    step function, with ``rows`` table rows and a pool of ``capacity`` slots of its own."""

    def __init__(self, step: DraftStep, rows: int, capacity: int,
                 running: Callable[[], Sequence[Req]]) -> None:
        self.step = step
        self.allocator = TokenAllocator(capacity)
        self.num_rows = rows
        self.free_rows = list(range(rows - 1, -1, -1))
        self.rows: dict[int, DraftRow] = {}  # id(req) -> its draft KV
        self.running = running  # the rank's running requests: the others' rows are freed

    @property
    def used_slots(self) -> int:
        """Draft pool slots held by requests (0 once none drafts)."""
        return self.allocator.capacity - self.allocator.available

    def reset(self) -> None:
        """Forget every request's draft KV (FlushCache; the rank is idle)."""
        self.rows.clear()
        self.allocator.reset()
        self.free_rows = list(range(self.num_rows - 1, -1, -1))

    def release_gone(self) -> None:
        """Free the draft KV of requests that are no longer running."""
        if not self.rows:
            return
        alive = {id(r) for r in self.running()}
        for key in [k for k, kv in self.rows.items() if k not in alive]:
            self._free(key)

    def _free(self, key: int) -> None:
        kv = self.rows.pop(key)
        if kv.slots:
            self.allocator.free(kv.slots)
        self.free_rows.append(kv.row)

    def _row_for(self, req: Req, positions: int) -> DraftRow | None:
        """The request's draft KV with slots for ``positions`` positions; None (nothing
        held) when the draft pool or the table has no room."""
        kv = self.rows.get(id(req))
        if kv is None or kv.req is not req:
            if kv is not None:
                self._free(id(req))
            if not self.free_rows:
                return None
            kv = DraftRow(req, self.free_rows.pop())
            self.rows[id(req)] = kv
        missing = positions - len(kv.slots)
        if missing > 0:
            slots = self.allocator.alloc(missing)
            if slots is None:
                self._free(id(req))
                return None
            kv.slots.extend(slots)
        return kv

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """Greedy drafts of the draft model (see :meth:`_draft`); none this step when the
        draft model fails (logged; every draft KV is dropped and recomputed later): a
        draft is only a guess, the requests decode on."""
        self.release_gone()
        try:
            return self._draft(reqs, limits)
        except Exception:  # noqa: BLE001 - the target decodes without drafts
            logger.exception("the draft model failed: this step drafts nothing")
            self.reset()
            return [[] for _ in reqs]

    def _draft(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """One extend step (each request's tokens since its last draft), then up to
        ``max(limits) - 1`` decode steps, all drafting requests batched in each."""
        drafts: list[list[int]] = [[] for _ in reqs]
        work: list[tuple[int, DraftRow, int]] = []  # (index, draft KV, sequence length)
        seqs: list[SeqInput] = []
        for i, (req, limit) in enumerate(zip(reqs, limits)):
            if limit <= 0:
                continue
            seq_len = req.seq_len
            # positions fed: the sequence, then every draft token but the last
            kv = self._row_for(req, seq_len + limit - 1)
            if kv is None:
                continue
            start = min(kv.valid, seq_len - 1)
            seqs.append(SeqInput(
                req_idx=kv.row, prefix_len=start, token_ids=req.tokens(start, seq_len),
                table_start=start, table_slots=kv.slots[start:seq_len], sampling=GREEDY,
                prompt_ids=[], output_ids=[]))
            work.append((i, kv, seq_len))
        if not work:
            return drafts
        outs = self.step(seqs)
        live: list[tuple[int, DraftRow, int]] = []
        for (i, kv, seq_len), out in zip(work, outs):
            kv.valid = seq_len
            if out is None or out.error is not None:
                continue
            drafts[i].append(out.token_id)
            live.append((i, kv, seq_len))
        for n in range(1, max(limits)):
            live = [w for w in live if len(drafts[w[0]]) < limits[w[0]]]
            if not live:
                break
            seqs = []
            for i, kv, seq_len in live:
                pos = seq_len + n - 1
                seqs.append(SeqInput(
                    req_idx=kv.row, prefix_len=pos, token_ids=[drafts[i][-1]],
                    table_start=pos, table_slots=[kv.slots[pos]], sampling=GREEDY,
                    prompt_ids=[], output_ids=[]))
            outs = self.step(seqs)
            still = []
            for w, out in zip(live, outs):
                if out is not None and out.error is None:
                    drafts[w[0]].append(out.token_id)
                    still.append(w)
            live = still
        return drafts
