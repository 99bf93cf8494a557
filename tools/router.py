"""`make router`: the SMG router in front of a worker, started in the background; returns once
the router lists the worker's model and holds its tokenizer, so the next command can use it.

    python tools/router.py [--worker-urls grpc://127.0.0.1:30000] [--port 8080]
    python tools/router.py --stop        # `make router-stop`

Its log goes to build/router.log, its pid to build/router.pid. A router that exits or is not
ready within --timeout seconds fails this command with the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
LOG, PID = BUILD / "router.log", BUILD / "router.pid"


def get_json(url: str) -> dict:
    """The JSON body at ``url``; {} while the router is not answering."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return {}


def ready_models(base: str) -> list[str]:
    """The models the router lists whose tokenizer it has loaded (empty until then)."""
    models = [m["id"] for m in get_json(f"{base}/v1/models").get("data", [])]
    loaded = {t.get("name") for t in get_json(f"{base}/v1/tokenizers").get("tokenizers", [])}
    return models if models and set(models) <= loaded else []


def start_time(pid: int) -> str:
    """When process ``pid`` started (field 22 of /proc/PID/stat, clock ticks since boot):
    with the pid, it names one process, not a later one that got the same number."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[19].decode()


def running_pid() -> int | None:
    """The router's pid from build/router.pid while that process still runs."""
    try:
        pid_text, started = PID.read_text().split()
        pid = int(pid_text)
        if start_time(pid) != started:
            return None
    except (OSError, ValueError):
        return None
    return pid


def stop() -> int:
    pid = running_pid()
    if pid is None:
        print("router: not running")
        return 0
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        os.killpg(pid, sig)  # its own shutdown may wait for requests in flight: then KILL
        deadline = time.monotonic() + wait_s
        while running_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if running_pid() is None:
            break
    else:
        print(f"router: pid {pid} did not stop", file=sys.stderr)
        return 1
    PID.unlink(missing_ok=True)
    print(f"router: stopped (pid {pid})")
    return 0


def start(args: argparse.Namespace) -> int:
    if (pid := running_pid()) is not None:
        print(f"router: already running (pid {pid}); `make router-stop` stops it",
              file=sys.stderr)
        return 1
    BUILD.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "smg.launch_router", "--worker-urls", *args.worker_urls,
           "--host", args.host, "--port", str(args.port),
           "--prometheus-host", args.host, "--prometheus-port", str(args.prometheus_port)]
    with open(LOG, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "NO_COLOR": "1"})
    PID.write_text(f"{proc.pid} {start_time(proc.pid)}\n")
    base = f"http://{args.host}:{args.port}"
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = LOG.read_text(errors="replace")[-3000:]
            print(f"router: exited with {proc.returncode}; the end of {LOG}:\n{tail}",
                  file=sys.stderr)
            PID.unlink(missing_ok=True)
            return 1
        models = ready_models(base)
        if models:
            print(f"router: {base} serves {', '.join(models)} (pid {proc.pid}, log "
                  f"{os.path.relpath(LOG)}); "
                  "`make router-stop` stops it")
            return 0
        time.sleep(0.5)
    print(f"router: not ready after {args.timeout:.0f} s (is the worker serving on "
          f"{' '.join(args.worker_urls)}?); see {LOG}; `make router-stop` stops it",
          file=sys.stderr)
    return 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker-urls", nargs="+", default=["grpc://127.0.0.1:30000"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--prometheus-port", type=int, default=29000)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--stop", action="store_true", help="stop the router started here")
    args = p.parse_args()
    return stop() if args.stop else start(args)


if __name__ == "__main__":
    sys.exit(main())
