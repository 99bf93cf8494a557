"""A rank's late imports (scheduler/late_imports.py): nothing a rank does before READY
imports torch._dynamo or xgrammar, the late-imports thread alone imports them afterwards,
and the profiler's start and a grammar compile wait for it instead of importing on their
own threads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys, tempfile, threading
import torch

WATCHED = ("torch._dynamo", "torch._inductor", "sympy", "xgrammar", "transformers")
importers = {}


class Probe:  # records the thread that imports each watched module, finds nothing itself
    def find_spec(self, name, path=None, target=None):
        if name in WATCHED:
            importers.setdefault(name, set()).add(threading.current_thread().name)


sys.meta_path.insert(0, Probe())
from sglang_admin.messages import StartProfileReq
from sglang_admin.model.default_model import ensure_default_model
from sglang_admin.scheduler import late_imports
from sglang_admin.scheduler.grammar import GrammarQueue, XGrammarBackend
from sglang_admin.scheduler.profiling.profiler import Profiler
from sglang_admin.model.loader import load_model

# a rank's start: the model built on the meta device, allocated and loaded (and a memory
# release and re-allocation, as ReleaseMemoryOccupation and Resume do)
model, _ = load_model(sys.argv[1], dtype=torch.float32, device=torch.device("cpu"))
model.release_parameters()
model.allocate_parameters(torch.device("cpu"))
at_start = sorted(m for m in WATCHED if m in sys.modules)
backend = XGrammarBackend(f"{ensure_default_model()}/tokenizer.json", 261, (257, 259))
queue = GrammarQueue.for_backend(backend)
late_imports.start_in_background()  # the rank: right after READY
# at once, as a StartProfile and a constrained request arriving with the READY
prof = Profiler(0, "cpu")
ok, text = prof.start(StartProfileReq(rid="r", output_dir=tempfile.mkdtemp(), profile_id="p",
                                      activities=["CPU"], with_stack=True))
assert ok, text
assert late_imports.imported()  # the profile started only once the imports were done
torch.ones(4) + 1
ok, text, files = prof.stop()
assert ok and files.files, text
queue.submit("r", "regex", "[0-9]+")
while not (done := queue.poll()):
    pass
assert done[0].state is not None, done[0].error
queue.shutdown()
print(at_start)
print(sorted((name, sorted(threads)) for name, threads in importers.items()))
"""


def test_profile_and_grammar_wait_for_the_late_imports_thread(tmp_path: Path) -> None:
    """Nothing a rank does before READY imports torch._dynamo, sympy, xgrammar or
    transformers: loading a model (meta build, allocate, load, release, allocate) reached
    ops whose Python references import dynamo (nn.Embedding's normal_, arange and
    empty_like on meta tensors), ~2 s of every rank's start; the checkpoint has RoPE
    scaling (llama3) and untied embeddings, the paths with most ops. Afterwards only the
    late-imports thread imports them, even when a profile (with Python stacks) starts and a
    grammar compiles at once: the profiler's start waits for it (on the loop, torch.profiler's
    dynamo import took seconds where HealthCheck wants an answer within 3 s; traced, an import
    made the profile's stop hold the GIL past the 15 s heartbeat probe), and so does a
    compile (an import in a compile thread froze a rank). A fresh interpreter (~3 s), since
    this one has imported them."""
    from tests.unit.test_model_loader import _tiny

    path = _tiny(tmp_path / "m", tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    at_start, importers = done.stdout.splitlines()[-2:]
    assert at_start == "[]"
    assert importers == str([(name, ["late-imports"]) for name in
                             ("sympy", "torch._dynamo", "torch._inductor", "transformers",
                              "xgrammar")])



_DELAY_PROBE = """
import sys, time
from sglang_admin.scheduler import late_imports

# two stdlib modules nothing here imported stand in for torch._dynamo and xgrammar: the
# schedule is what this checks (the probe above imports the real ones), and a fresh
# interpreter that imports torch cost ~3 s of CPU a run
late_imports.PROFILER_MODULES, late_imports.GRAMMAR_MODULES = ("colorsys",), ("wave",)
assert "colorsys" not in sys.modules and "wave" not in sys.modules and "torch" not in sys.modules
late_imports.DELAY_S = float(sys.argv[1])
late_imports.start_in_background(grammar_at_once=sys.argv[2] == "grammar-first")
time.sleep(0.3)
print(late_imports.imported(), "colorsys" in sys.modules, "wave" in sys.modules)
if sys.argv[2] == "ask":
    late_imports.wait_until_imported()  # as a profile's start: the thread starts now
elif sys.argv[2] == "grammar-first":  # a PD leg: a compile waits for the grammar's alone
    late_imports.wait_for_grammar()
    print(late_imports.imported(), "colorsys" in sys.modules, "wave" in sys.modules)
    late_imports.wait_until_imported()  # then a profile's start: the rest now
else:
    deadline = time.monotonic() + 60
    while not late_imports.imported():  # the delay runs out: it starts by itself
        assert time.monotonic() < deadline
        time.sleep(0.05)
print(late_imports.imported(), "colorsys" in sys.modules, "wave" in sys.modules)
"""


@pytest.mark.parametrize("how", ["ask", "delay", "grammar-first"])
def test_the_late_imports_wait_for_their_delay_or_the_first_that_needs_them(how: str) -> None:
    """Scheduled at READY, the imports do not run before their delay unless a profile's
    start or a compile asks (a short-lived worker never pays for them). A PD leg's grammar
    modules come at once, the profiler's after the delay, and a compile waits for the
    grammar's alone. Stand-in modules (the probe above checks the real ones, and that only
    the late-imports thread imports them)."""
    delay = "1" if how == "delay" else "600"
    done = subprocess.run([sys.executable, "-c", _DELAY_PROBE, delay, how], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    if how == "grammar-first":
        assert done.stdout.splitlines()[-3:] == ["False False True", "False False True",
                                                 "True True True"]
    else:
        assert done.stdout.splitlines()[-2:] == ["False False False", "True True True"]
