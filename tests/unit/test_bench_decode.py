"""tools/bench_decode.py (what tools/gpu_check.sh runs on a GPU) works, on a tiny CPU model."""

from __future__ import annotations

import re

from tools.bench_decode import main


def test_times_decode_steps_and_prints_the_bound(capsys) -> None:
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "1", "4",
                 "--context", "16", "--steps", "4", "--bandwidth-gbs", "50"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = [re.match(r"batch +(\d+): step +([\d.]+) ms \(median of (\d+)\), bound", line)
               for line in lines[1:]]
    assert [(int(m[1]), int(m[3])) for m in figures if m] == [(1, 4), (4, 4)]
    assert all(float(m[2]) > 0 for m in figures if m)


def test_profiles_the_timed_steps_on_lanes(capsys) -> None:
    """--profile prints torch.profiler's table of the timed steps (the top ops by own time)."""
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "4",
                 "--context", "8", "--steps", "3", "--lanes", "2", "--threads", "1",
                 "--profile"]) == 0
    out = capsys.readouterr().out
    assert "Self CPU time total" in out
    assert re.search(r"batch +4: step +[\d.]+ ms \(median of 3\)", out)
