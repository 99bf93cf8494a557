"""tools/bench_pd_transfer.py works: every method it can start moves the bytes (the
receiver's CRC32 equals the sender's) and gets a figure beside raw's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="mooncake-transfer-engine-non-cuda not installed")
def test_bench_moves_checked_bytes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_pd_transfer.py", "--tokens", "3", "17", "--layers", "2",
         "--row-bytes", "96", "--rounds", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())["sizes"]
    assert set(figures) == {"3", "17"}
    assert figures["17"]["bytes"] == 17 * 96 * 2 * 2
    for size in figures.values():
        methods = size["methods"]
        assert {"raw", "mooncake"} <= set(methods)
        assert all(m["bytes_checked"] and m["gb_s"] > 0 for m in methods.values())
        assert methods["raw"]["ratio"] == 1.0
    assert "x raw" in proc.stdout
