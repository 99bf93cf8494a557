"""The LoRA serve flags: bad values exit 2 with one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_admin.cli import build_parser, lora_paths

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--max-loaded-loras", "0"], ["--max-lora-rank", "-1"]])
def test_bad_lora_numbers_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {argv[0]}: must be a positive integer" in err


def test_lora_paths_are_checked(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert lora_paths([f"x={tmp_path / 'a'}", str(tmp_path / "b")], 2) == (
        ("x", str(tmp_path / "a")), ("b", str(tmp_path / "b")))
    with pytest.raises(ValueError, match="is not a directory"):
        lora_paths([f"x={tmp_path / 'nope'}"], 2)
    with pytest.raises(ValueError, match="given twice"):
        lora_paths([f"x={tmp_path / 'a'}", f"x={tmp_path / 'b'}"], 2)
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        lora_paths([f"={tmp_path / 'a'}"], 2)
    with pytest.raises(ValueError, match="--max-loaded-loras is 1"):
        lora_paths([f"x={tmp_path / 'a'}", f"y={tmp_path / 'b'}"], 1)


def test_serve_with_a_missing_adapter_exits_2_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sglang_admin", "serve", "--lora-paths",
         f"x={tmp_path / 'missing'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--lora-paths" in done.stderr and "is not a directory" in done.stderr
