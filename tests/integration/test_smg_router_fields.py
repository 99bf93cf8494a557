"""The router's fields mean what they mean in SGLang, checked through the real SMG gateway
(`smg` on PyPI) in front of one worker.

The worker serves a copy of the default model changed in two places: its
generation_config.json names temperature 0.3 (the gateway fills a request's unset
temperature from GetModelInfo.default_sampling_params_json), and its tokenizer's pad token
is the added token ``</think>`` (one token: the end of a think span for --reasoning-parser
qwen3). Gateway and worker both run with --reasoning-parser qwen3.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")

from sglang_admin.pb import common_pb2 as pb  # noqa: E402
from tests.conftest import (  # noqa: E402
    ROOT,
    ServerProc,
    free_port,
    greedy,
    run_generate,
    start_server,
)
from tests.integration.test_smg_router import http, stop_router, wait_for  # noqa: E402

THINK_END = 260  # the default model's pad token, renamed
TEMPERATURE = 0.3
THINK_CHAT = [{"role": "user", "content": "Think, then answer."}]
REASONING_AT = 5  # the greedy answer's </think> position (make_checkpoint)
# ChatML with Qwen3's thinking switch: the model thinks unless enable_thinking is false
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@dataclass
class Gateway:
    worker: ServerProc
    router: subprocess.Popen
    router_log: Path
    base: str
    model: str


def chat_prompt_ids(model: Path | str) -> list[int]:
    """THINK_CHAT through the checkpoint's template, as the gateway tokenizes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template(THINK_CHAT, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def swap_tokens(model: Path, a: int, b: int) -> None:
    """Relabel tokens ``a`` and ``b``: their rows of the embedding and of the output layer
    trade places, so the model says ``b`` wherever it said ``a`` and reads ``b`` as ``a``."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    weights = load_file(str(path))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        w[[a, b]] = w[[b, a]]
    save_file(weights, str(path), metadata={"format": "pt"})


def make_checkpoint(out: Path) -> None:
    """The default model with temperature 0.3 in generation_config.json, token 260 (its pad
    token) renamed ``</think>`` (a plain added token: it decodes to its text), a thinking
    chat template, and token 260 traded with the token its greedy answer to THINK_CHAT
    gives at position REASONING_AT (found with transformers), so that answer ends its
    think span there."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_admin.model.default_model import ensure_default_model

    shutil.copytree(ensure_default_model(), out)
    gen = json.loads((out / "generation_config.json").read_text())
    gen.update(temperature=TEMPERATURE, top_k=0)  # top_k 0: no limit (SGLang's -1)
    gen.pop("pad_token_id", None)
    (out / "generation_config.json").write_text(json.dumps(gen))
    config = json.loads((out / "config.json").read_text())
    config.pop("pad_token_id", None)
    (out / "config.json").write_text(json.dumps(config))
    tok = json.loads((out / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["id"] == THINK_END:
            added.update(content="</think>", special=False)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    tcfg["added_tokens_decoder"][str(THINK_END)].update(content="</think>", special=False)
    tcfg.pop("pad_token", None)
    tcfg["chat_template"] = THINK_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg))
    prompt = chat_prompt_ids(out)
    model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=REASONING_AT + 1,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    answer = seq[0, len(prompt):].tolist()
    token = answer[REASONING_AT]
    assert token not in prompt and token not in answer[:REASONING_AT], answer
    assert THINK_END not in answer, answer
    swap_tokens(out, token, THINK_END)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("smg-fields")
    model = tmp / "model"
    make_checkpoint(model)
    worker = start_server(tmp, "--model-path", str(model), "--reasoning-parser", "qwen3",
                          "--log-requests")
    router: subprocess.Popen | None = None
    try:
        port = free_port()
        router_log = tmp / "router.log"
        cmd = [
            sys.executable, "-m", "smg.launch_router",
            "--worker-urls", f"grpc://127.0.0.1:{worker.port}",
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
            "--reasoning-parser", "qwen3", "--log-level", "info",
        ]
        with open(router_log, "w") as log:
            router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      env={**os.environ, "NO_COLOR": "1"})
        g = Gateway(worker, router, router_log, f"http://127.0.0.1:{port}", str(model))

        def healthy() -> bool:
            if router.poll() is not None:
                raise RuntimeError(f"router exited:\n{router_log.read_text()[-4000:]}")
            try:
                status, body = http("GET", f"{g.base}/workers", timeout=5)
            except OSError:
                return False
            return status == 200 and any(w.get("is_healthy") for w in body.get("workers", []))

        wait_for(healthy, 60, "the worker healthy in GET /workers")
        yield g
    finally:
        if router is not None:
            stop_router(router)
        worker.stop(signal.SIGTERM, timeout=30)


def test_model_info_reports_the_checkpoints_sampling_defaults(gateway: Gateway) -> None:
    info = gateway.worker.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert json.loads(info.default_sampling_params_json) == {"temperature": TEMPERATURE,
                                                            "top_k": 0}
    assert info.max_req_input_len == min(info.max_context_length, _capacity(gateway)) - 1
    status, body = http("GET", f"{gateway.base}/workers")
    labels = body["workers"][0]["labels"]
    assert json.loads(labels["default_sampling_params_json"])["temperature"] == TEMPERATURE


def _capacity(gateway: Gateway) -> int:
    return gateway.worker.stub().GetServerInfo(pb.GetServerInfoRequest(),
                                               timeout=10).max_total_num_tokens


LONG = {"type": "object", "properties": {"text": {"type": "string",
                                                  "pattern": "^[a-z]{200}$"}},
        "required": ["text"], "additionalProperties": False}


def test_chat_without_max_tokens_runs_past_128_to_its_natural_end(gateway: Gateway) -> None:
    """No max_tokens: the gateway leaves max_new_tokens unset and the worker generates up to
    the context (as SGLang's scheduler), not 128 tokens. The answer asked for is a JSON
    object with a 200-letter string (over 200 tokens with the byte-level tokenizer); it ends
    with "stop" when the object is complete. Thinking off: the random model would think to
    the end of the context before its constrained answer."""
    status, body = http("POST", f"{gateway.base}/v1/chat/completions", {
        "model": gateway.model,
        "messages": [{"role": "user", "content": "Write a long word."}],
        "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "long", "schema": LONG, "strict": True}},
    }, timeout=300)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] > 200, body["usage"]
    assert len(json.loads(choice["message"]["content"])["text"]) == 200


def _first_token_logprobs(gateway: Gateway, ids: list[int]) -> dict[int, float]:
    """log p(first token) at temperature 1 (the model's own distribution), top 20."""
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids), return_logprob=True, top_logprobs_num=20,
        sampling_params=pb.SamplingParams(temperature=1.0, max_new_tokens=1, top_k=-1),
    )
    (resp,) = list(gateway.worker.stub().Generate(req, timeout=60))
    top = resp.complete.output_logprobs.top_logprobs[0]
    return dict(zip(top.token_ids, top.values))


def _at(logprobs: dict[int, float], token: int, temperature: float) -> float:
    """p(token) at ``temperature``, from the top-20 logprobs (the rest of the vocabulary
    weighs little once sharpened; the bound below leaves room for it)."""
    weights = {t: math.exp(lp / temperature) for t, lp in logprobs.items()}
    return weights[token] / sum(weights.values())


def test_unset_temperature_samples_at_the_checkpoints_default(gateway: Gateway) -> None:
    """The gateway's /generate without a temperature: the worker samples at 0.3 (the
    checkpoint's generation_config), checked by the first token's frequency over 240 draws
    against its probability at 0.3 and at 1.0."""
    # the prompt (of a few) whose top token's probability differs most between 1.0 and 0.3
    prompts = [[5, 17, 99, 3, 250, 64, 7, 42], [100, 101, 102], [42] * 12, [7, 8, 9, 10]]
    best = None
    for ids in prompts:
        lps = _first_token_logprobs(gateway, ids)
        top = max(lps, key=lps.get)
        gap = _at(lps, top, TEMPERATURE) - math.exp(lps[top])
        if best is None or gap > best[0]:
            best = (gap, ids, top, lps)
    _, ids, top, lps = best
    p_cold, p_warm = _at(lps, top, TEMPERATURE), math.exp(lps[top])
    draws = 240
    sigma = math.sqrt(p_cold * (1 - p_cold) / draws)
    assert p_cold - p_warm > 8 * sigma, (p_cold, p_warm)  # the check can tell them apart

    def one(_: int) -> int:
        status, body = http("POST", f"{gateway.base}/generate", {
            "model": gateway.model, "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
        })
        assert status == 200, body
        out = body[0] if isinstance(body, list) else body
        return out["output_ids"][0]

    with ThreadPoolExecutor(8) as pool:
        counts = Counter(pool.map(one, range(draws)))
    seen = counts[top] / draws
    assert abs(seen - p_cold) < 4 * sigma + 0.02, (seen, p_cold, p_warm, counts.most_common(5))
    assert len(counts) > 1  # sampled, not greedy


def test_reasoning_tokens_are_counted_up_to_the_end_of_the_think_span(
    gateway: Gateway,
) -> None:
    """require_reasoning (the gateway sets it for a thinking chat template) with
    --reasoning-parser: the worker counts the output tokens up to and including
    ``</think>`` (as SGLang's scheduler); the gateway reports them as
    usage.completion_tokens_details.reasoning_tokens. The checkpoint's greedy answer to
    this chat emits ``</think>`` at output position REASONING_AT (make_checkpoint)."""
    ids = chat_prompt_ids(gateway.model)
    tokens, _ = run_generate(gateway.worker.stub(), greedy(ids, 24), timeout=60)
    assert tokens.index(THINK_END) == REASONING_AT, tokens  # the worker's own greedy answer
    status, body = http("POST", f"{gateway.base}/v1/chat/completions", {
        "model": gateway.model, "messages": THINK_CHAT, "temperature": 0, "max_tokens": 24,
        "ignore_eos": True,
    }, timeout=120)
    assert status == 200, body
    usage = body["usage"]
    assert usage["completion_tokens"] == 24, usage
    assert usage["completion_tokens_details"]["reasoning_tokens"] == REASONING_AT + 1, usage
    # thinking off: the gateway does not ask, nothing is counted
    status, body = http("POST", f"{gateway.base}/v1/chat/completions", {
        "model": gateway.model, "messages": THINK_CHAT, "temperature": 0, "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": False},
    }, timeout=120)
    assert status == 200, body
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0, body["usage"]
