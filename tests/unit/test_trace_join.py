"""trace_join: a session's segment traces joined into one gzipped trace by a child
process (the JSON parse would hold a rank's GIL, stalling its loop, for seconds)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_admin.scheduler.profiling import trace_join
from sglang_admin.scheduler.profiling.export import join_traces


def _part(path: Path, base_ns: int, names: list[str]) -> str:
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank"}}]
    events += [{"ph": "X", "name": n, "ts": 10.0 * i, "dur": 1, "pid": 1} for i, n in enumerate(names)]
    path.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": base_ns,
                                "traceEvents": events}))
    return str(path)


def test_parts_are_joined_on_the_first_parts_time_base(tmp_path: Path) -> None:
    parts = [_part(tmp_path / "a", 1_000_000, ["s1", "s2"]), _part(tmp_path / "b", 3_000_000, ["s3"])]
    out = tmp_path / "p.trace.json.gz"
    join_traces(parts, str(out))
    data = json.loads(gzip.decompress(out.read_bytes()))
    assert data["schemaVersion"] == 1 and data["baseTimeNanoseconds"] == 1_000_000
    assert [e["name"] for e in data["traceEvents"]] == ["process_name", "s1", "s2", "s3"]
    assert data["traceEvents"][-1]["ts"] == 2000.0  # 2 ms later than the first part's base
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "p.trace.json.gz"]


def test_a_failed_join_raises_with_the_childs_reason(tmp_path: Path) -> None:
    parts = [_part(tmp_path / "a", 0, ["s1"]), str(tmp_path / "missing")]
    with pytest.raises(RuntimeError) as err:
        join_traces(parts, str(tmp_path / "p.trace.json.gz"))
    assert "joining 2 trace segments failed: FileNotFoundError" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no output, no .tmp


def test_the_script_runs_alone_and_checks_its_arguments(tmp_path: Path) -> None:
    """It runs as a plain script (standard library only), without the package on the path."""
    done = subprocess.run([sys.executable, "-I", trace_join.__file__, "only-out"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "usage: trace_join.py" in done.stderr
    part = _part(tmp_path / "a", 0, ["s1"])
    done = subprocess.run([sys.executable, "-I", trace_join.__file__, "o.json.gz", part],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(gzip.decompress((tmp_path / "o.json.gz").read_bytes()))["traceEvents"]
