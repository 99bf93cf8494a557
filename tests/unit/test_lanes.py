"""model/lanes.py: how a CPU step's sequences are cut into lanes and decode groups."""

from __future__ import annotations

from sglang_admin.model.lanes import group_by_length, lane_cuts


def test_lanes_get_about_equal_work() -> None:
    assert lane_cuts([(200, 0), (200, 0)], 2) == [(0, 1), (1, 2)]
    # the prompt is most of the work: the decode sequences share a lane, it has one alone
    assert lane_cuts([(1, 50)] * 4 + [(300, 0)], 2) == [(0, 4), (4, 5)]
    # a cached prefix makes a prompt chunk dearer (its tokens attend to more keys)
    assert lane_cuts([(100, 0), (100, 0), (100, 2000)], 2) == [(0, 2), (2, 3)]
    cuts = lane_cuts([(64, 0)] * 9, 3)
    assert cuts == [(0, 3), (3, 6), (6, 9)]


def test_a_lane_is_never_empty_and_small_steps_stay_whole() -> None:
    assert lane_cuts([(500, 0)], 2) == [(0, 1)]  # one sequence cannot be cut
    assert lane_cuts([(2, 0), (2, 0)], 2) == [(0, 2)]  # not worth a thread
    assert lane_cuts([(300, 0), (1, 0), (1, 0)], 3) == [(0, 1), (1, 2), (2, 3)]
    for lanes in (2, 3, 5):
        cuts = lane_cuts([(n, 0) for n in (5, 400, 7, 90, 33, 1000)], lanes)
        assert cuts[0][0] == 0 and cuts[-1][1] == 6
        assert all(a < b for a, b in cuts) and all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))


def test_decode_groups_pad_less_than_one_group() -> None:
    assert group_by_length([]) == []
    assert group_by_length([7] * 10) == [(0, 10)]  # no padding: one group
    lengths = sorted([20, 30, 40, 300, 310, 320, 600, 610, 620, 630] * 4)
    runs = group_by_length(lengths)
    assert 1 < len(runs) <= 4
    assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
    assert all(a < b and b == c for (a, b), (c, _) in zip(runs, runs[1:]))
    padded = sum((b - a) * lengths[b - 1] for a, b in runs)
    assert padded < 0.8 * len(lengths) * lengths[-1]
