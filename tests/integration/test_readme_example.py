"""The README's first Python call runs as written against a real worker."""

from __future__ import annotations

import contextlib
import io
import re

from sglang_admin.pb import common_pb2 as pb
from tests.conftest import ROOT, ServerProc


def test_the_readme_first_call_runs(server: ServerProc) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("A first call"):]
    code = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    assert "127.0.0.1:30000" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("127.0.0.1:30000", server.target), "README.md", "exec"), {})
    tokens = eval(out.getvalue())  # the example prints the list of generated token ids
    # what the worker generates for the example's request, asked over raw gRPC: the same
    # greedy tokens, max_new_tokens of them unless the model's EOS ended it sooner
    call = re.search(r"generate_tokens\(\[([0-9, ]+)\], max_new_tokens=(\d+)\)", code)
    assert call, "the README's example no longer calls generate_tokens([ids], max_new_tokens=N)"
    ids, n = [int(t) for t in call.group(1).split(",")], int(call.group(2))
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=pb.SamplingParams(temperature=0.0,
                                                               max_new_tokens=n))
    want = [r.complete for r in server.stub().Generate(req, timeout=60)][-1]
    assert tokens == list(want.output_ids)
    assert len(tokens) == n or want.finish_reason == "stop"
