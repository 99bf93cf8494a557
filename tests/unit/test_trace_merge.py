"""trace_merge: the ranks' traces of a profile merged by a child process of the server (the
JSON parse would hold the server's GIL, stalling its event loop, for seconds)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_admin.server import profiles, trace_merge


def _trace(path: Path, base_ns: int, names: list[str]) -> str:
    events = [{"ph": "M", "name": "process_labels", "pid": 1, "args": {}}]
    events += [{"ph": "X", "name": n, "ts": 5.0, "dur": 1, "pid": 1} for n in names]
    path.write_bytes(gzip.compress(json.dumps(
        {"baseTimeNanoseconds": base_ns, "traceEvents": events}).encode()))
    return str(path)


def _record(tmp_path: Path, cap: int = 1 << 30) -> profiles.ProfileRecord:
    return profiles.ProfileRecord("p1", "p1", str(tmp_path), True, cap)


def test_every_ranks_events_in_one_trace_labelled_by_rank(tmp_path: Path) -> None:
    files = [_trace(tmp_path / "p1-TP-0-DP-0.trace.json.gz", 1000, ["a"]),
             _trace(tmp_path / "p1-TP-0-DP-1.trace.json.gz", 3000, ["b"])]
    merged, note = profiles.merge_traces(_record(tmp_path), files)
    assert note == "" and merged == [str(tmp_path / "p1-merged.trace.json.gz")]
    events = json.loads(gzip.decompress(Path(merged[0]).read_bytes()))["traceEvents"]
    assert [e["args"]["labels"] for e in events if e["ph"] == "M"] == ["DP-0", "DP-1"]
    assert [(e["name"], e["ts"]) for e in events if e["ph"] == "X"] == [("a", 5.0), ("b", 7.0)]


def test_a_tp_followers_trace_is_labelled_with_its_tp_rank(tmp_path: Path) -> None:
    files = [_trace(tmp_path / f"p1-TP-{t}-DP-1.trace.json.gz", 1000, [f"t{t}"])
             for t in (0, 1)]
    merged, _ = profiles.merge_traces(_record(tmp_path), files)
    events = json.loads(gzip.decompress(Path(merged[0]).read_bytes()))["traceEvents"]
    assert [e["args"]["labels"] for e in events if e["ph"] == "M"] == ["DP-1", "DP-1 TP-1"]


def test_over_the_cap_nothing_is_written_and_the_note_says_why(tmp_path: Path) -> None:
    files = [_trace(tmp_path / "p1-TP-0-DP-0.trace.json.gz", 0, ["a"])]
    merged, note = profiles.merge_traces(_record(tmp_path, cap=1), files)
    assert merged == [] and "over its cap of 1 bytes" in note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p1-TP-0-DP-0.trace.json.gz"]


def test_a_failed_merge_raises_with_the_childs_reason(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as err:
        profiles.merge_traces(_record(tmp_path), [str(tmp_path / "p1-TP-0-DP-0.trace.json.gz")])
    assert "merging the profile's traces failed: FileNotFoundError" in str(err.value)


def test_the_script_runs_alone_and_checks_its_arguments(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-I", trace_merge.__file__, str(tmp_path), "p1", "x"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "usage: trace_merge.py" in done.stderr
