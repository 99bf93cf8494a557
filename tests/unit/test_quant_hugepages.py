"""The batch-1 step's weights on transparent huge pages (model/quant/hugepages.py): copies
with the same values, in order, each on a page of its own, in one buffer aligned to 2 MB;
nothing copied where the kernel gives no huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.quant import hugepages

needs_thp = pytest.mark.skipif(hugepages.thp_mode() not in ("always", "madvise"),
                               reason="transparent huge pages are off on this machine")


def test_the_mode_is_read_from_the_kernels_line(tmp_path: Path) -> None:
    line = tmp_path / "enabled"
    line.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(line)) == "madvise"
    line.write_text("[never]\n")
    assert hugepages.thp_mode(str(line)) == "never"
    assert hugepages.thp_mode(str(tmp_path / "missing")) == ""


def test_no_copy_where_huge_pages_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "thp_mode", lambda path="": "never")
    assert hugepages.on_huge_pages([torch.zeros(1 << 20, dtype=torch.uint8)]) is None


def test_no_copy_where_none_are_granted(monkeypatch: pytest.MonkeyPatch) -> None:
    """madvise accepted but the process's huge pages did not grow: the tensors are better
    left where they are (a copy on 4 KB pages read slower)."""
    monkeypatch.setattr(hugepages, "thp_mode", lambda path="": "madvise")
    monkeypatch.setattr(hugepages, "_huge_kb", lambda: 0)
    assert hugepages.on_huge_pages([torch.zeros(3 << 20, dtype=torch.uint8)]) is None


@needs_thp
def test_copies_keep_values_shapes_and_order_on_huge_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies where the kernel grants the pages (whether it does depends on how
    fragmented the machine's memory is at that moment: the process's huge-page count is
    made to say it did, the madvise and the copies are real)."""
    counts = iter([0, 1 << 30])  # kB of huge pages before the copies, after them
    monkeypatch.setattr(hugepages, "_huge_kb", lambda: next(counts))
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (3 << 20,), generator=gen, dtype=torch.uint8),
               torch.randn(1000, 33, generator=gen).to(torch.bfloat16),
               torch.randint(0, 256, (1 << 16, 80), generator=gen, dtype=torch.uint8),
               torch.randn(7, generator=gen)]
    views = hugepages.on_huge_pages(tensors)
    assert views is not None
    for got, want in zip(views, tensors):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        assert got.data_ptr() % 4096 == 0
    starts = [v.data_ptr() for v in views]
    assert starts == sorted(starts) and starts[0] % hugepages.HUGE == 0
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    views[1].zero_()  # copies: the originals are untouched
    assert tensors[1].abs().sum() > 0
