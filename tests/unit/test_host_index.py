"""model/host_index.py: a CPU step's index tensors are views of one persistent buffer, made
once per layout; the request-to-token table is written from Python."""

from __future__ import annotations

import torch

from sglang_admin.model import host_index
from sglang_admin.model.host_index import StagingBuffer, host_table


def test_each_part_comes_back_as_a_tensor_of_its_values() -> None:
    staging = StagingBuffer()
    parts = [[5, 6, 7], [], [2**40, -3], [0]]
    got = staging.load(parts)
    assert [t.tolist() for t in got] == parts
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in got)


def test_a_layout_seen_before_reuses_its_views_with_the_new_values() -> None:
    staging = StagingBuffer()
    first = staging.load([[1, 2], [3]])
    second = staging.load([[9, 8], [7]])
    assert all(a is b for a, b in zip(first, second))  # no new tensors for a known layout
    assert [t.tolist() for t in second] == [[9, 8], [7]]
    other = staging.load([[1], [2, 3]])  # same total, another layout: its own views
    assert [t.tolist() for t in other] == [[1], [2, 3]]


def test_the_buffer_grows_for_a_step_larger_than_it() -> None:
    staging = StagingBuffer(capacity=4)
    small = staging.load([[1, 2]])
    big = list(range(1000))
    got = staging.load([big, [42]])
    assert staging.capacity >= 1001
    assert got[0].tolist() == big and got[1].tolist() == [42]
    assert staging.load([[3, 4]])[0].tolist() == [3, 4]  # views made again over the new buffer
    assert small[0].tolist() == [1, 2]  # a view of the old buffer stays valid memory


def test_the_view_cache_is_bounded() -> None:
    staging = StagingBuffer()
    for n in range(1, 3 * host_index.MAX_LAYOUTS):
        assert staging.load([list(range(n))])[0].tolist() == list(range(n))
    assert len(staging._views) <= host_index.MAX_LAYOUTS


def test_host_table_writes_show_in_the_tensor() -> None:
    table, words = host_table(3, 5)
    assert table.shape == (3, 5) and table.dtype == torch.int64 and not table.any()
    words[2 * 5 + 4] = 77
    words[0] = -1
    assert table[2, 4].item() == 77 and table[0, 0].item() == -1
    table.zero_()  # and torch's writes show through the view
    assert words[2 * 5 + 4] == 0
