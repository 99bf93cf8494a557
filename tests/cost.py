"""Per-module cost of a pytest run: wall seconds and CPU seconds of the test process plus
every process it started (the workers and their ranks, alive or reaped).

Turned on by ``SGLANG_ADMIN_TEST_COST=path.json`` (``tests/conftest.py`` registers it); the
file gets one row per test module (and one for collection, where the session workers boot),
and ``python -m tests.cost path.json`` prints them as a table. The figures the suite's cost
page quotes come from it (docs/test-suite-cost.md).

CPU is ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` + the user and system time (their own and their
reaped children's) of every live descendant, read from ``/proc``: a session worker's CPU is
thus counted in the module that spent it, not when it is reaped at the session's end.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds of the process and its reaped children)."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        # fields[0] is the state (field 3); utime..cstime are fields 14-17
        table[int(entry)] = (int(fields[1]), sum(int(v) for v in fields[11:15]) / _TICK)
    return table


def cpu_now() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += table[pid][1]
        todo.extend(children.get(pid, []))
    return total


class CostRecorder:
    """Adds each test's wall and CPU (setup, call and teardown) to its module's row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, dict[str, float]] = {}
        self.t0 = time.monotonic()
        self.c0 = cpu_now()

    def _add(self, key: str, wall: float, cpu: float, tests: int) -> None:
        row = self.rows.setdefault(key, {"wall": 0.0, "cpu": 0.0, "tests": 0})
        row["wall"] += wall
        row["cpu"] += cpu
        row["tests"] += tests

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_collection(self, session: pytest.Session):
        yield
        self._add("(collection)", time.monotonic() - self.t0, cpu_now() - self.c0, 0)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        t, c = time.monotonic(), cpu_now()
        yield
        self._add(item.nodeid.split("::")[0], time.monotonic() - t, cpu_now() - c, 1)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        total = {"wall": time.monotonic() - self.t0, "cpu": cpu_now() - self.c0,
                 "tests": sum(int(r["tests"]) for r in self.rows.values())}
        path = self.path
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # each xdist worker: a file of its own
        if worker:
            path = path.with_name(f"{path.stem}.{worker}{path.suffix}")
        path.write_text(json.dumps({"modules": self.rows, "total": total,
                                    "loadavg": os.getloadavg()}, indent=1))


def table(*paths: str) -> str:
    """The rows of cost files (one per xdist worker, or one) as a markdown table, the most
    CPU first; the total's wall is the longest file's."""
    data: dict = {"modules": {}, "total": {"wall": 0.0, "cpu": 0.0, "tests": 0}}
    for path in paths:
        part = json.loads(Path(path).read_text())
        for name, row in part["modules"].items():
            into = data["modules"].setdefault(name, {"wall": 0.0, "cpu": 0.0, "tests": 0})
            for key in into:
                into[key] += row[key]
        t = data["total"]
        t["wall"] = max(t["wall"], part["total"]["wall"])
        t["cpu"] += part["total"]["cpu"]
        t["tests"] += part["total"]["tests"]
    lines = ["| module | tests | wall s | CPU s |", "|---|---|---|---|"]
    for name, row in sorted(data["modules"].items(), key=lambda kv: -kv[1]["cpu"]):
        lines.append(f"| `{name}` | {int(row['tests'])} | {row['wall']:.1f} | {row['cpu']:.1f} |")
    t = data["total"]
    lines.append(f"| total | {int(t['tests'])} | {t['wall']:.1f} | {t['cpu']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(*sys.argv[1:]))
