"""tools/bench_matrix.py end to end at its smallest: a tiny checkpoint built from a config,
a real worker and a real transformers process, one round, the floor, the table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools import bench_matrix
from tools.workloads import Workload

pytest.importorskip("transformers")


@pytest.mark.long
def test_the_smallest_matrix_runs_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "matrix.json"
    code = bench_matrix.main([
        "--shapes", "tiny", "--dtypes", "float32", "--workloads", "chat", "n8", "--small",
        "--rounds", "1", "--cores", "1", "--floor-steps", "2", "--floor-rounds", "2",
        "--cache-dir", str(tmp_path / "cache"), "--json", str(out),
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    cells = {c["workload"]: c for c in result["cells"]}
    assert set(cells) == {"chat", "n8"}
    for cell in cells.values():
        assert not cell["error"]
        assert cell["served"][0] > 0 and cell["transformers"][0] > 0
        assert cell["ratio"] == pytest.approx(cell["served"][0] / cell["transformers"][0])
    floor = result["floors"]["tiny float32"]
    assert floor["step_s"] > 0 and floor["floor_s"] > 0
    # floor and step alternated twice: the best of each counts
    assert len(floor["floor_rounds_s"]) == len(floor["step_rounds_s"]) == 2
    assert floor["floor_s"] == min(floor["floor_rounds_s"])
    assert floor["step_s"] == min(floor["step_rounds_s"])
    # 2 layers x 4 projections + the LM head, each 2 x 32 x in x out FLOPs
    layer, head, layers = bench_matrix.linear_shapes(
        json.loads((tmp_path / "cache" / "tiny-v1" / "config.json").read_text()))
    assert floor["flops"] == sum(2 * 32 * k * n for k, n in layer) * layers + 2 * 32 * head[0] * head[1]
    rows = [line for line in printed.splitlines() if line.startswith("| tiny | float32 |")]
    assert len(rows) == 2
    assert all(re.search(r"\| [\d.]+x \| [\d.]+ / [\d.]+ ms = [\d.]+x \|$", r) for r in rows)


def test_the_workloads_count_what_each_request_asks_for() -> None:
    for name in bench_matrix.WORKLOADS:
        for small in (False, True):
            work = bench_matrix.workload(name, 320, small)
            assert len(work.prompts) == len(work.outputs)
            assert work.output_tokens == sum(work.outputs) * work.n
            assert all(3 <= t < 320 for p in work.prompts for t in p)
    chat = bench_matrix.workload("chat", 49152, False)
    assert len(chat.prompts) == 32
    assert all(30 <= len(p) <= 60 for p in chat.prompts)
    assert all(64 <= n <= 256 for n in chat.outputs)
    long = bench_matrix.workload("long", 49152, False)
    assert all(1024 <= len(p) <= 2048 for p in long.prompts) and set(long.outputs) == {16}
    n8 = bench_matrix.workload("n8", 49152, False)
    assert n8.n == 8 and n8.temperature == 1.0
    assert isinstance(n8, Workload)
