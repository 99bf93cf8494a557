"""Batch preparation: a step's sequences checked and turned into the forward's inputs (token
ids, positions, the request-to-token table's writes, attention metadata per lane).

:class:`BatchBuilder` owns the request-to-token table (``req_to_token[req_idx, pos]`` is the
pool slot of position ``pos`` of the sequence living in row ``req_idx``) and the per-lane
scratch buffers the attention reuses; :meth:`BatchBuilder.prepare` returns a
:class:`ForwardBatch`, which the runner runs through the model and samples from.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from sglang_admin.model.attention import AttentionMetadata, DecodeGroup, ExtendSeq, PagedDecode
from sglang_admin.model.attention.choice import extend_kernel_takes
from sglang_admin.model.cpu_kernels import CpuKernels
from sglang_admin.model.decode_batch import DecodeBatch
from sglang_admin.model.extend_batch import ExtendBatch, tile_kernel
from sglang_admin.model.host_index import StagingBuffer, host_table
from sglang_admin.model.lanes import group_by_length, lane_cuts
from sglang_admin.model.step_io import InvalidSequence, SeqInput


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's inputs to the model and to sampling."""

    ordered: list[SeqInput]  # the step's sequences: decode ones (one new token) first
    offsets: list[int]  # flat index of each ordered sequence's first token, then the end
    sampled: list[SeqInput]  # the ordered sequences that sample a token
    select: torch.Tensor  # flat index of each sampled sequence's last token
    every_row: bool  # one token per sequence, all sampled: every hidden row is sampled
    input_ids: torch.Tensor  # [T] the new tokens, flattened in ordered order
    positions: torch.Tensor  # [T]
    lanes: list[tuple[int, int]]  # ranges of ordered, one forward each (model/lanes.py)
    metas: list[AttentionMetadata]  # one per lane


class BatchBuilder:
    """Checks a step's sequences, writes their slots into the request-to-token table and
    builds the index tensors and attention metadata the forward reads.

    CPU: the table is written from Python and the step's index tensors are views of one
    persistent buffer (model/host_index.py); CUDA copies them to the device.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_running_requests: int,
        context_length: int,
        token_capacity: int,
        sliding_window: int | None,
        num_heads: int,
        kv_width: int,
        cpu_kernels: CpuKernels | None,
        extend_kernel: bool,
        lanes: int,
        cuda_attention: bool = False,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.max_running_requests = max_running_requests
        self.context_length = context_length
        self.token_capacity = token_capacity
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.kv_width = kv_width  # num_kv_heads * head_dim: one pool row of one layer
        self.cpu_kernels = cpu_kernels
        self.extend_kernel = extend_kernel  # prefill chunks may go through the CPU kernel
        # whether its bfloat16 prefill kernel multiplies on AMX tiles (attention/choice.py)
        self.kernel_tiles = (cpu_kernels is not None and dtype == torch.bfloat16
                             and extend_kernel and tile_kernel(cpu_kernels))
        self.lanes = lanes
        # CUDA (model/attention/choice.py): decode through the Triton kernel, a cached
        # prefix's extend without a mask; tests set it on CPU to check those paths' numerics
        self.cuda_attention = cuda_attention
        self._table_words: memoryview | None = None
        self._staging: StagingBuffer | None = None
        if device.type == "cpu":
            self.req_to_token, self._table_words = host_table(max_running_requests,
                                                              context_length)
            self._staging = StagingBuffer()
        else:
            self.req_to_token = torch.zeros(
                max_running_requests, context_length, dtype=torch.int64, device=device
            )
        self._arange = torch.arange(context_length, device=device)
        self._table_dirty = False  # written since the last reset (a flush of an idle pool skips it)
        # CPU only: persistent scratch for gathered K/V rows (CUDA's caching allocator
        # already reuses memory; on CPU fresh multi-megabyte buffers cost page faults)
        self._scratch: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # one per lane
        self._score_scratch: list[torch.Tensor | None] = []  # one per lane

    def reset(self) -> None:
        """Forget every sequence's slots (cache flush)."""
        if self._table_dirty:
            self.req_to_token.zero_()
            self._table_dirty = False

    def drop_scratch(self) -> None:
        """Free the gathered-K/V scratch buffers (the KV pool is released)."""
        self._scratch = []

    # ------------------------------------------------------------ one step

    def prepare(self, seqs: list[SeqInput], decode: list[SeqInput], extend: list[SeqInput],
                one_lane: bool) -> ForwardBatch:
        """The step's inputs; ``decode``/``extend``: seqs split by one new token or more
        (decode may be reordered). Raises :class:`InvalidSequence` before any device work."""
        # torch's attention pads a group of decode sequences to its longest: shortest first
        if self.cpu_kernels is None:
            decode.sort(key=lambda s: s.prefix_len)
        ordered = decode + extend
        nd = len(decode)
        rows, ctx, capacity = self.max_running_requests, self.context_length, self.token_capacity

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
        (t_ids, t_pos, t_cells, t_tcells, t_tvals, t_select, t_dec_rows,
         t_dec_lens) = self._pack([input_ids, positions, token_cells, table_cells, table_vals,
                                   select, dec_rows, dec_lens])
        # a decode step: every new token's slot is the one just written to its table cell
        # (no lookup in the table)
        slots_written = t_tvals if table_cells == token_cells else None
        if table_cells:
            self._write_table(table_cells, table_vals, t_tcells, t_tvals)

        # ---- attention metadata per lane, once for all layers
        lanes = [(0, len(ordered))] if one_lane else self.split_lanes(ordered)
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
        return ForwardBatch(ordered, offsets, sampled, t_select, len(select) == offset,
                            t_ids, t_pos, lanes, metas)

    def _pack(self, parts: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """One int64 tensor per list, on the device (CPU: views of the staging buffer)."""
        if self._staging is not None:
            return self._staging.load(parts)
        flat: list[int] = []
        for part in parts:
            flat.extend(part)
        # from an int64 array: a fifth of torch.tensor's cost for a list of Python ints
        packed = torch.frombuffer(array("q", flat), dtype=torch.int64)
        return packed.to(self.device, non_blocking=True).split([len(part) for part in parts])

    def _write_table(self, cells: list[int], slots: list[int], t_cells: torch.Tensor,
                     t_slots: torch.Tensor) -> None:
        """req_to_token's flat cells set to slots (from Python on CPU, else one index_copy_)."""
        words = self._table_words
        if words is not None:
            for cell, slot in zip(cells, slots):
                words[cell] = slot
        else:
            self.req_to_token.view(-1).index_copy_(0, t_cells, t_slots)
        self._table_dirty = True

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

    def split_lanes(self, ordered: list[SeqInput]) -> list[tuple[int, int]]:
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
        if self.cuda_attention and nd:  # the Triton kernel reads the table itself
            meta.paged_decode = PagedDecode(table, dec_rows, t_dec_lens, max(dec_lens))
        groups = (group_by_length(dec_lens)
                  if self.cpu_kernels is None and not self.cuda_attention else [])
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
        # prefill kernel (reading the pool through the table) where it is faster than
        # torch's: in float32 (one thread) chunks up to EXTEND_MAX_TOKENS with torch on one
        # thread as well; in bfloat16 (torch's threads) every chunk (extend_kernel_takes)
        kernel_extend = self.extend_kernel and (self.dtype == torch.bfloat16
                                                or torch.get_num_threads() == 1)
        start = 0
        for s in extend:
            p, n = s.prefix_len, len(s.token_ids)
            seq = ExtendSeq(start, n)
            meta.extend_seqs.append(seq)
            start += n
            if kernel_extend and extend_kernel_takes(self.dtype, p, n,  # no masks or gathers
                                                     kernel_tiles=self.kernel_tiles):
                seq.slots, seq.prefix = table[s.req_idx, : p + n], p
                continue
            in_window = window is not None and p + n > window
            if p and self.cuda_attention and not in_window:  # no mask: see ExtendSeq
                seq.kv_index, seq.lower_right = table[s.req_idx, : p + n], True
                gathered = max(gathered, p + n)
                continue
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
        kernel_seqs = [seq for seq in meta.extend_seqs if seq.slots is not None]
        if kernel_seqs and self.dtype == torch.bfloat16:  # one call per layer for them all
            meta.extend_batch = ExtendBatch.of(
                self.cpu_kernels, [(e.start, e.n, e.prefix, e.slots) for e in kernel_seqs])
        if self.device.type == "cpu" and gathered:
            meta.gather_k, meta.gather_v = self._gather_scratch(lane, gathered)
        return meta

    def _scores_scratch(self, lane: int, length: int) -> torch.Tensor:
        """Lane ``lane``'s scratch for the decode kernel's scores (grown, never shrunk)."""
        while len(self._score_scratch) <= lane:
            self._score_scratch.append(None)
        need = self.num_heads * length
        have = self._score_scratch[lane]
        if have is None or have.numel() < need:
            have = torch.empty(max(need, 2 * (have.numel() if have is not None else 0)))
            self._score_scratch[lane] = have
        return have

    def _gather_scratch(self, lane: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lane ``lane``'s scratch for gathered K and V rows, at least ``rows`` rows (grown,
        never shrunk)."""
        while len(self._scratch) <= lane:
            self._scratch.append(None)
        have = self._scratch[lane]
        if have is None or have[0].shape[0] < rows:
            cap = max(rows, 2 * have[0].shape[0] if have is not None else 0)
            shape = (cap, self.kv_width)
            have = (torch.empty(shape, dtype=self.dtype, device=self.device),
                    torch.empty(shape, dtype=self.dtype, device=self.device))
            self._scratch[lane] = have
        return have
