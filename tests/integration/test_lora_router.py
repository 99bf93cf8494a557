"""What the SMG gateway (smg 1.13.0) does with an adapter choice: it does not forward it.

Its gRPC request builders (crates/grpc_client/src/sglang_scheduler.rs in lightseekorg/smg)
never set GenerateRequest.lora_id, and ``lora_path`` of /generate or /v1/chat/completions is
parsed but dropped. This test pins that, so a gateway that starts forwarding adapters shows
up here (and the end-to-end path can then be tested instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("smg", reason="the SMG gateway (pip package `smg`) is not installed")

from tests.conftest import ROOT, free_port, greedy, run_generate, start_server  # noqa: E402
from tests.integration.test_smg_router import http, stop_router  # noqa: E402
from tests.lora_models import build_adapter  # noqa: E402


def test_the_gateway_drops_lora_path(tmp_path: Path) -> None:
    from sglang_admin.model.default_model import ensure_default_model

    adapter = build_adapter(Path(ensure_default_model()), "attn", tmp_path / "a", seed=3)
    worker = start_server(tmp_path, "--enable-lora", "--max-lora-rank", "8",
                          "--lora-paths", f"a={adapter}")
    port = free_port()
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "smg.launch_router", "--worker-urls",
             f"grpc://127.0.0.1:{worker.port}", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"},
        )
    try:
        base = f"http://127.0.0.1:{port}"
        model = None
        for _ in range(240):
            try:
                status, body = http("GET", f"{base}/v1/models", timeout=2)
                if status == 200 and body.get("data"):
                    model = body["data"][0]["id"]
                    break
            except OSError:
                pass
            time.sleep(0.25)
        assert model is not None, (tmp_path / "router.log").read_text()[-3000:]
        prompt = [72, 101, 108, 108, 111]
        stub = worker.stub()
        with_adapter, _ = run_generate(stub, greedy(prompt, 8, lora_id="a"), timeout=60)
        plain, _ = run_generate(stub, greedy(prompt, 8), timeout=60)
        assert with_adapter != plain  # on the worker, the adapter changes the output
        req = {"model": model, "input_ids": prompt,
               "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        outputs = []
        for lora_path in ("a", "not-loaded"):
            for _ in range(40):  # until the gateway has the worker in its pool
                status, body = http("POST", f"{base}/generate", {**req, "lora_path": lora_path})
                if status == 200:
                    break
                time.sleep(0.25)
            assert status == 200, body  # an unknown adapter is not refused: never sent
            outputs.append((body[0] if isinstance(body, list) else body)["output_ids"])
        assert outputs == [plain, plain]
    finally:
        stop_router(router)
        worker.stop()
