"""Step time of one replica over two nodes vs on one host vs tp 1, and the bytes per step
that cross between the nodes, served end to end on this machine, side by side in one run.

Three workers started together: tp 1; ``--tp-size 2`` on one host; ``--tp-size 2 --nnodes
2``, two ``sglang-admin serve`` trees on 127.0.0.1. After a warm-up round each, the rounds
alternate between them (tp 1, one host, two nodes, tp 1, ...), so that the machine's load
drifts over all three alike; a round is ``--batch`` greedy streams of ``--new-tokens``
tokens at once, and its step time the round's wall time over the rank's forward steps in it
(GetServerInfo's ``forward_steps``). Reported: each worker's best and median step time, and
the ratios taken within each round (its three measurements are seconds apart) with their
median over the rounds. The bytes per step are the TCP bytes node 1's rank process sent and
received in a round (``ss -tin`` on its sockets: the step commands and the all-reduces),
over the same steps. Loopback has no wire latency: across real hosts each of a step's
collectives adds a network round trip (docs/multinode.md).

``--codec-only``: only the cost of a step's command on the wire (multinode/wire.py) beside
pickle's (what ``broadcast_object_list`` did), encode + decode of one batch, alternated.

Usage: python -m tools.bench_multinode [--batch 8] [--new-tokens 64] [--rounds 7]
       python -m tools.bench_multinode --codec-only [--batch 64] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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


@dataclass
class Worker:
    """One measured worker: its processes, its gRPC target, the rank whose bytes count."""

    name: str
    procs: list[subprocess.Popen]
    target: str
    remote_pid: int | None = None  # node 1's rank process (the two-node worker)
    steps: list[float] = field(default_factory=list)  # seconds per step, one per round
    wire: list[float] = field(default_factory=list)  # bytes per step, one per round

    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(self.target))


def prompts(batch: int) -> list[list[int]]:
    return [[(i * 13 + j) % 250 + 2 for j in range(32)] for i in range(batch)]


def one_round(worker: Worker, opts: argparse.Namespace, record: bool = True) -> None:
    """``--batch`` greedy streams at once on ``worker``; its step time (and bytes per step)
    appended when ``record``."""
    stub = worker.stub()
    s0, t0 = steps(stub), time.perf_counter()
    b0 = tcp_bytes(worker.remote_pid) if worker.remote_pid else 0
    with cf.ThreadPoolExecutor(opts.batch) as pool:
        list(pool.map(lambda p: run_generate(stub, greedy(p, opts.new_tokens), timeout=600),
                      prompts(opts.batch)))
    wall = time.perf_counter() - t0
    n = steps(stub) - s0
    if record:
        worker.steps.append(wall / n)
        if worker.remote_pid:
            worker.wire.append((tcp_bytes(worker.remote_pid) - b0) / n)


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


def start_workers(tmp: Path, model: list[str]) -> list[Worker]:
    """The three workers, booting together; returned once every one serves."""
    workers = []
    for name, extra in (("tp1", []), ("tp2 one host", ["--tp-size", "2"])):
        proc, port = serve(tmp, name.replace(" ", "-"), *model, *extra)
        workers.append(Worker(name, [proc], f"127.0.0.1:{port}"))
    common = [*model, "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node0, port0 = serve(tmp, "node0", *common, "--node-rank", "0")
    node1, port1 = serve(tmp, "node1", *common, "--node-rank", "1")
    pair = Worker("tp2 over 2 nodes", [node0, node1], f"127.0.0.1:{port0}")
    workers.append(pair)
    try:
        for w in workers:
            wait_serving(w.target, w.procs[0], 600)
        info = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port1}")
                                           ).GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
        pair.remote_pid = int(info.scheduler_info["local_ranks"][0]["pid"])
    except BaseException:
        stop(*(p for w in workers for p in w.procs))
        raise
    return workers


def report(workers: list[Worker], opts: argparse.Namespace) -> None:
    base, host, pair = workers
    print(f"batch {opts.batch} x {opts.new_tokens} new tokens, {opts.rounds} rounds "
          f"alternated, load average {os.getloadavg()[0]:.1f}")
    print(f"{'worker':<18} {'best ms':>8} {'median ms':>10} {'bytes/step (node 1)':>20}")
    for w in workers:
        wire = f"{statistics.median(w.wire):,.0f}" if w.wire else ""
        print(f"{w.name:<18} {min(w.steps) * 1e3:8.2f} {statistics.median(w.steps) * 1e3:10.2f}"
              f" {wire:>20}")
    print("step-time ratios, within each round (median over rounds; best rounds' ratio):")
    for a, b in ((pair, host), (pair, base), (host, base)):
        within = [x / y for x, y in zip(a.steps, b.steps, strict=True)]
        print(f"  {a.name} / {b.name}: {statistics.median(within):.2f}x "
              f"({min(a.steps) / min(b.steps):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model-path", default=None, help="default: the embedded model")
    ap.add_argument("--codec-only", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=512, help="--codec-only's prompts")
    opts = ap.parse_args()
    if opts.codec_only:
        codec_costs(opts.batch, opts.prompt_len)
        return
    model = ["--model-path", opts.model_path] if opts.model_path else []
    with tempfile.TemporaryDirectory() as tmp_dir:
        workers = start_workers(Path(tmp_dir), model)
        try:
            for w in workers:
                one_round(w, opts, record=False)  # warm-up
            for _ in range(opts.rounds):
                for w in workers:
                    one_round(w, opts)
        finally:
            stop(*(p for w in workers for p in w.procs))
    report(workers, opts)


if __name__ == "__main__":
    main()
