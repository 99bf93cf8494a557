"""Merge every rank's trace of a profile into one trace per stage.

    python trace_merge.py OUTPUT_DIR STEM MAX_BYTES FILE [FILE ...]

prints ``{"written": [...], "note": "..."}``. The server runs this file as a child process
(standard library only, so it runs as a plain script): parsing the ranks' traces is one C
call per file that holds the GIL for seconds on a large trace, and in the server's process
that would stop its event loop (every stream, every HealthCheck) for as long.

Timestamps are moved onto a common base; each rank's processes are labelled with its DP
rank. The merged file is written under a temporary name of its own and renamed over the
final name only once complete; skipped (with a note) when it would take the profile over
its byte cap.

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import tempfile
from typing import Any


def _stage_of(path: str) -> str:
    name = os.path.basename(path)[: -len(".trace.json.gz")]
    for stage in ("EXTEND", "DECODE"):
        if name.endswith(f"-{stage}"):
            return stage
    return ""


def merge(output_dir: str, stem: str, max_bytes: int, files: list[str]) -> tuple[list[str], str]:
    """Write one trace per stage holding every rank's events; (files written, note)."""
    traces = [f for f in files if f.endswith(".trace.json.gz") and "-merged" not in f]
    total = sum(os.path.getsize(f) for f in files)
    written: list[str] = []
    by_stage: dict[str, list[str]] = {}
    for path in traces:
        by_stage.setdefault(_stage_of(path), []).append(path)
    for stage, paths in sorted(by_stage.items()):
        loaded = []
        for path in paths:
            with gzip.open(path, "rt") as f:
                loaded.append((path, json.load(f)))
        base = min(int(d.get("baseTimeNanoseconds", 0)) for _, d in loaded)
        events: list[dict[str, Any]] = []
        for path, data in loaded:
            match = re.search(r"-DP-(\d+)", os.path.basename(path))
            label = f"DP-{match.group(1)}" if match else "DP-0"
            tp = re.search(r"-TP-(\d+)", os.path.basename(path))
            if tp and tp.group(1) != "0":  # a TP follower's trace (--tp-size > 1)
                label += f" TP-{tp.group(1)}"
            shift_us = (int(data.get("baseTimeNanoseconds", 0)) - base) / 1000.0
            for ev in data.get("traceEvents", []):
                if shift_us and isinstance(ev.get("ts"), (int, float)):
                    ev["ts"] = ev["ts"] + shift_us
                if ev.get("ph") == "M" and ev.get("name") == "process_labels":
                    ev["args"] = {"labels": label}
                events.append(ev)
        merged = {"traceEvents": events, "baseTimeNanoseconds": base, "displayTimeUnit": "ms"}
        suffix = f"-{stage}" if stage else ""
        out = os.path.join(output_dir, f"{stem}-merged{suffix}.trace.json.gz")
        # A temporary name of its own (never listed: it does not end in .trace.json.gz),
        # renamed over the final name only once complete.
        fd, tmp = tempfile.mkstemp(
            dir=output_dir, prefix=f".{stem}-merged{suffix}.", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt") as f:
                json.dump(merged, f)
            size = os.path.getsize(tmp)
            if total + size > max_bytes:
                os.remove(tmp)
                return written, (
                    f"merged trace not written: it would take the profile over its cap of "
                    f"{max_bytes} bytes"
                )
            os.replace(tmp, out)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        total += size
        written.append(out)
    return written, ""




def main(argv: list[str]) -> int:
    """OUTPUT_DIR STEM MAX_BYTES FILE...: merge and print the outcome as JSON."""
    if len(argv) < 3 or not argv[2].isdigit():
        print("usage: trace_merge.py OUTPUT_DIR STEM MAX_BYTES FILE [FILE ...]", file=sys.stderr)
        return 2
    written, note = merge(argv[0], argv[1], int(argv[2]), argv[3:])
    print(json.dumps({"written": written, "note": note}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
