"""The README's first Python call runs as written against a real worker."""

from __future__ import annotations

import contextlib
import io
import re

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
    assert isinstance(tokens, list) and 1 <= len(tokens) <= 8
    assert all(isinstance(t, int) for t in tokens)
