"""The server's process never imports torch: only the scheduler ranks (scheduler/, model/)
do. Importing it there cost the server ~190 MiB of RSS for nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULES = (
    "sglang_admin.__main__", "sglang_admin.cli", "sglang_admin.server.launch",
    "sglang_admin.server.servicer",
)


def test_the_server_process_does_not_import_torch() -> None:
    code = "import sys\n" + "".join(f"import {m}\n" for m in SERVER_MODULES) + (
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
