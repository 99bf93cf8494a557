"""tools/gpu_check: the GPU's one command keeps working, checked on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("greedy", "logprobs", "sampling", "json", "lora", "refit", "memory", "profile", "push")


@pytest.mark.slow
@pytest.mark.long  # the device's one command run end to end, as the benchmarks' smoke runs
def test_the_served_checks_pass_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for name in CHECKS:
        assert any(line.startswith(f"PASS {name}: ") for line in lines), (name, out.stdout)
    assert f"{len(CHECKS)} passed, 0 failed" in lines


def test_the_shell_script_says_in_one_line_that_there_is_no_gpu() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 1
    assert re.fullmatch(r"gpu_check: no CUDA device visible to torch \(torch .+\): nothing to "
                        r"check\n", out.stdout), out.stdout
