"""Join the Chrome traces of a profiling session's consecutive segments into one file.

    python trace_join.py OUT.trace.json.gz PART0 PART1 ...

A rank runs this file as a child process (standard library only, so it runs as a plain
script): parsing a segment's JSON is one C call that holds the GIL for seconds on a large
trace, and in the rank's process that would stop its loop thread for as long.

Profiling is spread over several modules; their map is in ``scheduler/profiling/export.py``'s
docstring.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
from typing import Any


def join_traces(parts: list[str], out: str) -> None:
    """Join Chrome traces of consecutive segments into one gzipped trace, written
    atomically, one segment in memory at a time: events moved onto the first segment's
    time base; the first segment's other fields (metadata, device properties) kept."""
    tmp = out + ".tmp"
    header: dict[str, Any] = {}
    base = 0
    first_event = True
    try:
        with gzip.open(tmp, "wt") as f:
            f.write('{"traceEvents": [')
            for index, part in enumerate(parts):
                with open(part) as src:
                    data = json.load(src)
                part_base = int(data.get("baseTimeNanoseconds", 0))
                if index == 0:
                    header = {k: v for k, v in data.items() if k != "traceEvents"}
                    base = part_base
                shift_us = (part_base - base) / 1000.0
                for ev in data.get("traceEvents", []):
                    if index and ev.get("ph") == "M":  # process/thread names: from the first
                        continue
                    if shift_us and isinstance(ev.get("ts"), (int, float)):
                        ev["ts"] = ev["ts"] + shift_us
                    f.write(("" if first_event else ",") + json.dumps(ev))
                    first_event = False
                del data
            rest = json.dumps(header)[1:]  # '"key": value, ...}' or '}'
            f.write("]" + (", " + rest if rest != "}" else "}"))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, out)


def main(argv: list[str]) -> int:
    """OUT PART...: join the parts into OUT; exit 2 on bad arguments."""
    if len(argv) < 2:
        print("usage: trace_join.py OUT.trace.json.gz PART [PART ...]", file=sys.stderr)
        return 2
    join_traces(argv[1:], argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
