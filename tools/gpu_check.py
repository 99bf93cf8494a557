"""The served worker on one device, checked end to end: one line per check and a summary.

What a lent GPU has to prove, run as users run it: a worker started as its own process on
``--device`` (dp 1, or one rank per GPU with ``--dp-size``), driven through the client.
The reference is transformers (and peft) on the same device, on the embedded default model
(``float32``, TF32 off, so greedy tokens must be equal):

    greedy      tokens equal transformers' on a few prompts, on every rank
    logprobs    each generated token's logprob within 1e-3 of transformers'
    sampling    n=4 samples at temperature 1 complete with every token in the vocabulary
    json        a json_schema request's output parses and has the schema's key
    lora        a random PEFT adapter: greedy tokens equal peft's
    refit       UpdateWeightsFromDisk to a second checkpoint, then greedy equals its model
    memory      release kv_cache + weights, resume, greedy equals again
    profile     a 3-step profile writes its trace files
    push        a trainer pushes the first checkpoint's weights through a process group
                (gloo on CPU; nccl from a second GPU when one is visible), greedy equals

It runs on the CPU too (``--device cpu``), which is how the test suite keeps it working.
Usage: python tools/gpu_check.py [--device cuda|cpu] [--dp-size N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_admin.client.client import AsyncClient  # noqa: E402
from sglang_admin.client.trainer import WeightPusher  # noqa: E402
from sglang_admin.model.default_model import ensure_default_model  # noqa: E402
from sglang_admin.pb import common_pb2 as pb  # noqa: E402

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [3, 14, 15, 92, 65, 35, 89, 79], list(range(40, 90))]
NEW_TOKENS = 12
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
          "required": ["name"], "additionalProperties": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``python -m sglang_admin serve`` in a subprocess, stopped on exit."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "sglang_admin", "serve", "--port", str(self.port),
               "--grpc-http-sidecar-port", str(_free_port()), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).resolve().parents[1])

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait_serving(self, timeout_s: float = 600) -> None:
        until = time.monotonic() + timeout_s
        async with AsyncClient(self.target, timeout=5) as client:
            while time.monotonic() < until:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited {self.proc.returncode}:\n"
                                       f"{self.log.read_text()[-3000:]}")
                try:
                    if await client.health_v1() == "SERVING":
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"worker not SERVING after {timeout_s:.0f}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Reference:
    """transformers (+ peft) on the worker's device: greedy tokens and their logprobs."""

    def __init__(self, path: Path, device: torch.device) -> None:
        import transformers

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).to(device).eval()
        self.memo: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def greedy(self, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
        """Computed once per prompt: greedy decoding of the same weights gives the same tokens,
        and several checks compare against the same reference (the memo is per model)."""
        key = (tuple(prompt), n)
        if key not in self.memo:
            self.memo[key] = self._greedy(prompt, n)
        tokens, logprobs = self.memo[key]
        return list(tokens), list(logprobs)

    def _greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([prompt], device=self.device), max_new_tokens=n,
                min_new_tokens=n, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens, strict=True)]
        return tokens, logprobs


def random_copy(src: Path, dst: Path, seed: int) -> Path:
    """A copy of checkpoint ``src`` with every weight matrix perturbed (a 'trained' step)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists() and not (dst / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return dst


def build_adapter(base: Path, dst: Path) -> Path:
    """A random PEFT LoRA adapter (rank 8, attention and MLP projections) over ``base``."""
    import peft
    import transformers

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    wrapped.save_pretrained(dst, safe_serialization=True)
    return dst


class Checks:
    """Runs the checks in order, one line each; a failed check does not stop the rest."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    async def run(self, name: str, check: Callable[[], Awaitable[str]]) -> None:
        t0 = time.monotonic()
        try:
            detail = await check()
        except Exception as exc:  # noqa: BLE001 - a check's failure is reported, not raised
            self.failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:400]} "
                  f"({Path(where.filename).name}:{where.lineno})", flush=True)
            return
        self.passed += 1
        print(f"PASS {name}: {detail} ({time.monotonic() - t0:.1f}s)", flush=True)


async def greedy_equal(client: AsyncClient, ref: Reference, dp_size: int, lora_id: str = "",
                       reference: Callable[[list[int]], tuple[list[int], list[float]]] | None
                       = None) -> str:
    """Every prompt on every rank gives the reference's greedy tokens."""
    want_of = reference or ref.greedy
    for prompt in PROMPTS:
        want, _ = want_of(prompt)
        for rank in range(dp_size):
            got = await client.generate_tokens(prompt, NEW_TOKENS, ignore_eos=True,
                                               data_parallel_rank=rank, lora_id=lora_id)
            if got.tokens != want:
                raise AssertionError(f"rank {rank}, prompt of {len(prompt)}: {got.tokens} != "
                                     f"transformers' {want}")
    return f"{len(PROMPTS)} prompts x {dp_size} rank(s) token-equal"


async def main_async(ns: argparse.Namespace) -> int:
    device = torch.device(ns.device if ns.device != "cuda" else "cuda:0")
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    base = Path(ensure_default_model())
    # the worker boots while this process builds the second checkpoint, the adapter and the
    # reference
    worker = Worker(["--device", ns.device, "--dtype", "float32", "--dp-size", str(ns.dp_size),
                     "--enable-lora", "--max-lora-rank", "8", "--profile-dir", str(work)],
                    work / "worker.log")
    checks = Checks()
    try:
        second = random_copy(base, work / "step1", seed=1)
        adapter = build_adapter(base, work / "adapter")
        ref = Reference(base, device)
        step_refs: list[Reference] = []

        def step_ref() -> Reference:
            """transformers on the second checkpoint, loaded once for the refit and the push."""
            if not step_refs:
                step_refs.append(Reference(second, device))
            return step_refs[0]

        await worker.wait_serving()
        async with AsyncClient(worker.target, timeout=300) as client:
            info = await client.server_info()
            devices = [s.device for s in info.rank_states]
            print(f"worker on {', '.join(devices)} (dp {ns.dp_size})", flush=True)

            await checks.run("greedy", lambda: greedy_equal(client, ref, ns.dp_size))

            async def logprobs() -> str:
                prompt = PROMPTS[1]
                want_tokens, want = ref.greedy(prompt)
                params = pb.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS,
                                           ignore_eos=True)
                req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt),
                                         sampling_params=params, return_logprob=True)
                complete = None
                async for resp in client.stub.Generate(req, timeout=300):
                    if resp.HasField("complete"):
                        complete = resp.complete
                assert complete is not None and list(complete.output_ids) == want_tokens
                got = list(complete.output_logprobs.token_logprobs)
                worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
                assert worst < 1e-3, f"logprobs differ by {worst:.2e}"
                return f"{len(got)} logprobs within {worst:.1e}"
            await checks.run("logprobs", logprobs)

            async def sampling() -> str:
                params = pb.SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16,
                                           ignore_eos=True)
                samples = await client.generate_samples(PROMPTS[0], 4, sampling_params=params,
                                                        temperature=1.0, ignore_eos=True,
                                                        max_new_tokens=16)
                vocab = ref.model.config.vocab_size
                assert len(samples) == 4
                for s in samples:
                    assert len(s.tokens) == 16 and all(0 <= t < vocab for t in s.tokens)
                return f"4 samples of 16 tokens, {len({tuple(s.tokens) for s in samples})} distinct"
            await checks.run("sampling", sampling)

            async def json_schema() -> str:
                params = pb.SamplingParams(temperature=0.0, max_new_tokens=400,
                                           json_schema=json.dumps(SCHEMA))
                got = await client.generate_tokens(PROMPTS[0], sampling_params=params)
                # the default model's tokenizer is byte-level: ids below 256 are the bytes
                text = bytes(t for t in got.tokens if t < 256).decode("utf-8")
                value = json.loads(text)
                assert isinstance(value, dict) and "name" in value, text
                return f"parsed {text[:40]!r}"
            await checks.run("json", json_schema)

            async def lora() -> str:
                import peft

                resp = await client.load_lora_adapter("check", str(adapter))
                assert resp.success, resp.message
                wrapped = peft.PeftModel.from_pretrained(
                    ref.model, str(adapter), adapter_name="check").eval()
                lora_ref = Reference.__new__(Reference)
                lora_ref.device, lora_ref.model, lora_ref.memo = device, wrapped, {}
                try:
                    detail = await greedy_equal(client, ref, ns.dp_size, lora_id="check",
                                                reference=lora_ref.greedy)
                finally:
                    ref.model = wrapped.unload()  # the base model back, without the adapter
                return detail + " with the adapter"
            await checks.run("lora", lora)

            async def refit() -> str:
                resp = await client.update_weights_from_disk(str(second), weight_version="step1")
                assert resp.success, resp.message
                detail = await greedy_equal(client, ref, ns.dp_size, reference=step_ref().greedy)
                back = await client.update_weights_from_disk(str(base))
                assert back.success, back.message
                return detail + " after the refit"
            await checks.run("refit", refit)

            async def memory() -> str:
                released = await client.release_memory_occupation(["kv_cache", "weights"])
                assert released.success, released.message
                resumed = await client.resume_memory_occupation(["kv_cache", "weights"])
                assert resumed.success, resumed.message
                return (await greedy_equal(client, ref, ns.dp_size)) + " after release/resume"
            await checks.run("memory", memory)

            async def profile() -> str:
                started = await client.start_profile(num_steps=3, output_dir=str(work))
                assert started.success, started.message
                await client.generate_tokens(PROMPTS[2], NEW_TOKENS, ignore_eos=True)
                files: list[str] = []
                until = time.monotonic() + 120
                while not files and time.monotonic() < until:
                    files = await asyncio.to_thread(
                        lambda: [str(p) for p in work.rglob("*.trace.json*")])
                    await asyncio.sleep(0.5)
                assert files, "no trace file written"
                return f"{len(files)} trace file(s), e.g. {Path(files[0]).name}"
            await checks.run("profile", profile)

            async def push() -> str:
                import transformers

                source = transformers.AutoModelForCausalLM.from_pretrained(
                    second, dtype=torch.float32)
                if device.type == "cuda":
                    if torch.cuda.device_count() < ns.dp_size + 1:
                        return "skipped: nccl needs a GPU for the trainer beside the workers'"
                    trainer_device = f"cuda:{ns.dp_size}"
                    source = source.to(trainer_device)
                else:
                    trainer_device = None
                pusher = WeightPusher([worker.target], timeout_s=300, device=trainer_device)
                port = _free_port()
                await asyncio.to_thread(pusher.join, "127.0.0.1", port, "check")
                try:
                    await asyncio.to_thread(pusher.push, source.named_parameters(), "pushed")
                finally:
                    await asyncio.to_thread(pusher.destroy)
                detail = await greedy_equal(client, ref, ns.dp_size, reference=step_ref().greedy)
                backend = "nccl" if device.type == "cuda" else "gloo"
                return f"{backend} push; " + detail
            await checks.run("push", push)
    except Exception as exc:  # noqa: BLE001 - the worker (or the references) did not come up
        checks.failed += 1
        print(f"FAIL worker: {exc}", flush=True)
    finally:
        worker.stop()
    print(f"{checks.passed} passed, {checks.failed} failed", flush=True)
    return 0 if checks.failed == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--dp-size", type=int, default=1)
    ns = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # one line per check
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.simplefilter("ignore")
    return asyncio.run(main_async(ns))


if __name__ == "__main__":
    sys.exit(main())
