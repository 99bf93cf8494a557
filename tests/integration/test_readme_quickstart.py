"""The README's quick start, run as written: terminal 1's block (`make serve`) until it prints
the readiness line the README shows, then terminal 2's block (`make router` and the curl)
in a shell whose PATH has no .venv, as a fresh terminal's; the answer must name Paris.

The commands are parsed out of README.md, so editing the quick start changes what runs here.
They use the README's fixed ports (30000, 30001, 8080, 29000): the test is skipped while
something else holds one, and while the tree's install is stale (`make serve` would first
reinstall the package into .venv; `make test` runs the install before the tests).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

PORTS = (30000, 30001, 8080, 29000)  # the worker, its sidecar, the router, its metrics


def quick_start() -> tuple[list[str], list[str]]:
    """(the bash blocks, the text blocks) of the README's quick-start section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    section = section[:section.index("\n## ", 3)]
    blocks = re.findall(r"```(\w*)\n(.*?)\n```", section, re.S)
    return ([body for kind, body in blocks if kind == "bash"],
            [body for kind, body in blocks if kind == "text"])


def fresh_env() -> dict[str, str]:
    """This environment as a new terminal has it: no virtualenv on PATH. PYTHONPATH stays:
    it is how a test run points at this tree's package."""
    drop = ("VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in drop}  # `make test` runs this
    venv = str(ROOT / ".venv")
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep)
        if p and not os.path.realpath(p).startswith(os.path.realpath(venv))
        and not os.path.isfile(os.path.join(p, "activate")))
    env["NO_COLOR"] = "1"
    return env


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def command_lines(block: str) -> list[str]:
    """The lines of a bash block that start a command (not comments, not the rest of a
    quoted argument or of a line continued with a backslash)."""
    out, quote, cont = [], False, False
    for line in block.splitlines():
        if not quote and not cont and line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
        quote ^= line.count("'") % 2 == 1
        cont = line.rstrip().endswith("\\")
    return out


def test_every_readme_command_runs_in_a_fresh_terminal() -> None:
    """Each command of the README's bash blocks is `make` with a target of the Makefile,
    `curl`, or a program from .venv named by its path: none needs an activated venv."""
    readme = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    bad = []
    for block in re.findall(r"```bash\n(.*?)\n```", readme, re.S):
        for line in command_lines(block):
            word = line.split()[0]
            if word == "make":
                target = next((w for w in line.split()[1:] if "=" not in w), "")
                ok = target in targets
            else:
                ok = word == "curl" or (word.startswith(".venv/bin/")
                                        and (ROOT / word).exists())
            if not ok:
                bad.append(line)
    assert not bad, f"README commands a fresh terminal cannot run: {bad}"
    bash, text = quick_start()
    assert len(bash) == 2, "the quick start is two terminals: the server, then the client"
    assert bash[0].strip() == "make serve"
    assert command_lines(bash[1])[0] == "make router" and "curl" in bash[1]
    assert any("serving on" in t for t in text), "the readiness line is shown"


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written_and_answers_paris(tmp_path: Path) -> None:
    from sglang_admin.model.cpu_dtype import cpu_has_native_bf16

    bash, text = quick_start()
    env = fresh_env()
    stale = subprocess.run(["make", "-q", ".venv/.installed", ".venv/.smollm2"], cwd=ROOT,
                           env=env, capture_output=True).returncode
    if stale:
        pytest.skip("the install is older than pyproject.toml here: `make serve` would "
                    "reinstall into .venv first (run `make install smollm2`)")
    taken = [p for p in PORTS if port_taken(p)]
    if taken:
        pytest.skip(f"the README's ports {taken} are in use on this machine")
    ready = re.search(r"serving on (\S+): (\S+) in (\w+)", "\n".join(text))
    assert ready, "the README shows the readiness line"
    address, name = ready.group(1), ready.group(2)
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"

    server_log = tmp_path / "terminal1.log"
    with open(server_log, "w") as log:
        server = subprocess.Popen(["bash", "-c", bash[0]], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while f"serving on {address}" not in server_log.read_text(errors="replace"):
            assert server.poll() is None, server_log.read_text()[-4000:]
            assert time.monotonic() < deadline, server_log.read_text()[-4000:]
            time.sleep(0.5)
        out = server_log.read_text(errors="replace")
        # `make serve` (no --dtype): --dtype auto, bfloat16 where the CPU has it natively
        assert f"serving on {address}: {name} in {dtype}," in out, out[-3000:]
        why = "and a CPU with native bfloat16" if dtype == "bfloat16" else "would be emulated"
        assert re.search(rf"loaded: {dtype} on cpu \(--dtype auto: Q4_1 GGUF weights.*{why}",
                         out), out[-3000:]

        client = subprocess.run(["bash", "-e", "-c", bash[1]], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert client.returncode == 0, client.stdout + client.stderr
        lines = client.stdout.strip().splitlines()
        assert lines[0].startswith(f"router: http://127.0.0.1:8080 serves {name} ")
        answer = json.loads(lines[-1])  # the curl's body
        assert answer["model"] == name
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        stop = subprocess.run(["make", "router-stop"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # the Ctrl-C of terminal 1
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    assert stop.returncode == 0 and stop.stdout.startswith("router: stopped"), stop.stdout
    assert not port_taken(8080), "`make router-stop` left the router running"
