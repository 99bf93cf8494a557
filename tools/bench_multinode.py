"""Step time of one replica over two nodes vs on one host vs tp 1, and the bytes per step
that cross between the nodes, served end to end on this machine.

Three workers in turn, each started, warmed up and measured alike: tp 1; ``--tp-size 2`` on
one host; ``--tp-size 2 --nnodes 2``, two ``sglang-admin serve`` trees on 127.0.0.1. Each
runs ``--batch`` greedy streams of ``--new-tokens`` tokens at once, ``--rounds`` times; the
step time is the wall time over the rank's forward steps in that window (GetServerInfo's
``forward_steps``). The bytes per step are the TCP bytes node 1's rank process sent and
received in the window (``ss -tin`` on its sockets: the step commands and the all-reduces),
over the same steps. Loopback has no wire latency: across real hosts each of a step's
collectives adds a network round trip (docs/multinode.md).

``--codec-only``: only the cost of a step's command on the wire (multinode/wire.py) beside
pickle's (what ``broadcast_object_list`` did), encode + decode of one batch, alternated.

Usage: python -m tools.bench_multinode [--batch 8] [--new-tokens 64] [--rounds 3]
       python -m tools.bench_multinode --codec-only [--batch 64] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from sglang_admin.client.testing import free_port, greedy, run_generate, wait_serving
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]


def serve(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - the child keeps its descriptor
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_admin", "serve", "--port", str(port),
         "--grpc-http-sidecar-port", str(free_port()), "--max-total-tokens", "8192", *args],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, port


def tcp_bytes(pid: int) -> int:
    """Bytes sent + received on every TCP connection of process ``pid`` now."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    total, mine = 0, False
    for line in out.split("\n"):
        if not line.startswith(("\t", " ")):
            mine = f"pid={pid}," in line
            continue
        if mine:
            for key in ("bytes_sent", "bytes_received"):
                m = re.search(rf"{key}:(\d+)", line)
                total += int(m.group(1)) if m else 0
    return total


def steps(stub: pb_grpc.SglangSchedulerStub) -> int:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    return sum(s.forward_steps for s in info.rank_states)


def measure(target: str, opts: argparse.Namespace, remote_pid: int | None
            ) -> tuple[float, float | None]:
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(target))
    prompts = [[(i * 13 + j) % 250 + 2 for j in range(32)] for i in range(opts.batch)]

    def batch() -> None:
        with cf.ThreadPoolExecutor(opts.batch) as pool:
            list(pool.map(lambda p: run_generate(stub, greedy(p, opts.new_tokens),
                                                 timeout=600), prompts))

    batch()  # warm-up
    s0, b0, t0 = steps(stub), tcp_bytes(remote_pid) if remote_pid else 0, time.perf_counter()
    for _ in range(opts.rounds):
        batch()
    wall = time.perf_counter() - t0
    n = steps(stub) - s0
    per_step = None if remote_pid is None else (tcp_bytes(remote_pid) - b0) / n
    return wall / n, per_step


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def codec_costs(batch: int, prompt_len: int, rounds: int = 7) -> None:
    """Encode + decode of one step's command: the wire's beside pickle's, alternated."""
    import pickle  # only to compare with what the TP group used to send; nothing is sent

    from sglang_admin.messages import SamplingParams
    from sglang_admin.model.step_io import SeqInput
    from sglang_admin.multinode import wire

    seqs = [SeqInput(i, prompt_len + 100, [5], prompt_len + 100, [i * 4096 + 7],
                     SamplingParams(temperature=0.7), list(range(prompt_len)),
                     list(range(100))) for i in range(batch)]
    cmd = ("step", seqs)
    codecs = {"pickle": (pickle.dumps, pickle.loads), "wire": (wire.encode, wire.decode)}
    best = {name: float("inf") for name in codecs}
    sizes = {}
    for _ in range(rounds):
        for name, (enc, dec) in codecs.items():
            t0 = time.perf_counter()
            for _ in range(20):
                data = enc(cmd)
                dec(data)
            best[name] = min(best[name], (time.perf_counter() - t0) / 20)
            sizes[name] = len(data)
    print(f"one step's command, {batch} sequences of {prompt_len} prompt + 100 output ids "
          f"(best of {rounds}), load average {os.getloadavg()[0]:.1f}")
    for name in codecs:
        print(f"  {name:<7} {best[name] * 1e3:7.2f} ms encode+decode  {sizes[name]:>9,} bytes  "
              f"{best[name] / best['pickle']:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-path", default=None, help="default: the embedded model")
    ap.add_argument("--codec-only", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=512, help="--codec-only's prompts")
    opts = ap.parse_args()
    if opts.codec_only:
        codec_costs(opts.batch, opts.prompt_len)
        return
    model = ["--model-path", opts.model_path] if opts.model_path else []
    results: dict[str, tuple[float, float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name, extra in (("tp1", []), ("tp2 one host", ["--tp-size", "2"])):
            proc, port = serve(tmp, name.replace(" ", "-"), *model, *extra)
            try:
                wait_serving(f"127.0.0.1:{port}", proc, 300)
                results[name] = measure(f"127.0.0.1:{port}", opts, None)
            finally:
                stop(proc)
        init = free_port()
        common = [*model, "--tp-size", "2", "--nnodes", "2",
                  "--dist-init-addr", f"127.0.0.1:{init}"]
        node0, port0 = serve(tmp, "node0", *common, "--node-rank", "0")
        node1, port1 = serve(tmp, "node1", *common, "--node-rank", "1")
        try:
            wait_serving(f"127.0.0.1:{port0}", node0, 300)
            info = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port1}")
                                               ).GetServerInfo(pb.GetServerInfoRequest())
            rank_pid = int(info.scheduler_info["local_ranks"][0]["pid"])
            results["tp2 over 2 nodes"] = measure(f"127.0.0.1:{port0}", opts, rank_pid)
        finally:
            stop(node0, node1)
    base = results["tp1"][0]
    print(f"batch {opts.batch} x {opts.new_tokens} new tokens, {opts.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'worker':<18} {'step ms':>8} {'vs tp1':>7} {'bytes/step (node 1)':>20}")
    for name, (step, per_step) in results.items():
        extra = "" if per_step is None else f"{per_step:,.0f}"
        print(f"{name:<18} {step * 1e3:8.2f} {step / base:6.2f}x {extra:>20}")


if __name__ == "__main__":
    main()
