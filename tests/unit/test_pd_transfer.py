"""The PD KV transfer backend (zmq) byte for byte, its refusals, the bootstrap server's
input checks and the disaggregation flags' start-up check. Its data connection's wire
(groups, refusals on the stream, dead senders, fuzzed headers): test_pd_zmq_stream.py."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from sglang_admin.disaggregation.settings import check_flags
from sglang_admin.disaggregation.transfer import KVTransferError, PeerDescriptor
from sglang_admin.disaggregation.zmq_backend import ZmqBackend
from tests.zmq_pair import LAYERS, pool, started_pair


@pytest.fixture()
def pair():
    with started_pair() as both:
        yield both


@pytest.mark.parametrize("dtype, layout", [(torch.float32, "scattered"),
                                            (torch.bfloat16, "scattered"),
                                            (torch.float32, "runs")])
def test_a_transfer_lands_byte_for_byte(dtype: torch.dtype, layout: str) -> None:
    """Scattered slots, and one run of consecutive slots on each side (sent as a view of
    the pool, written as one block): the same bytes land, nothing else is written."""
    sender, receiver = ZmqBackend(), ZmqBackend()
    sender.register_buffers(pool(True, dtype=dtype))
    receiver.register_buffers(pool(False, dtype=dtype))
    sender.start()
    receiver.start()
    try:
        if layout == "runs":
            src, dst = list(range(5, 25)), list(range(30, 50))
        else:
            src = random.Random(1).sample(range(1, 64), 20)
            dst = random.Random(2).sample(range(1, 64), 20)
        untouched = sorted(set(range(64)) - set(dst))
        receiver.expect(7, dst)
        result = sender.send(7, receiver.descriptor(), src, dst, 10)
        assert result.ok, result.error
        assert result.nbytes == 20 * LAYERS * 2 * 2 * 8 * torch.tensor([], dtype=dtype).element_size()
        assert receiver.read_slots(dst) == sender.read_slots(src)
        assert receiver.checksum(dst) == sender.checksum(src)
        assert set(receiver.read_slots(untouched)) == {0}  # nothing else written
    finally:
        sender.close()
        receiver.close()


def test_data_for_a_room_not_expected_is_refused_and_not_written(pair) -> None:
    sender, receiver = pair
    result = sender.send(9, receiver.descriptor(), [1, 2], [3, 4], 10)
    assert not result.ok and "unknown room 9" in result.error and "kv transfer" in result.error
    assert set(receiver.read_slots([3, 4])) == {0}
    receiver.expect(9, [3, 4])
    receiver.release(9)  # aborted: later data is refused
    assert not sender.send(9, receiver.descriptor(), [1, 2], [3, 4], 10).ok


def test_other_slots_than_reserved_are_refused(pair) -> None:
    sender, receiver = pair
    receiver.expect(5, [3, 4])
    result = sender.send(5, receiver.descriptor(), [1, 2], [3, 9], 10)
    assert not result.ok and "slots differ" in result.error
    assert set(receiver.read_slots([9])) == {0}


def test_a_dead_receiver_fails_within_the_timeout(pair) -> None:
    sender, receiver = pair
    desc = receiver.descriptor()
    receiver.close()
    result = sender.send(1, desc, [1], [1], 0.5)
    assert not result.ok and "kv transfer failed" in result.error and result.seconds < 5


def test_rooms_to_one_peer_share_a_connection_until_it_dies(pair) -> None:
    """A sending thread keeps its connection to a peer once a room is answered (refused
    rooms too); a receiver that died mid-way fails the next room within the timeout, and one
    at a new endpoint is reached on a new connection."""
    sender, receiver = pair
    for room in (1, 2, 3):
        receiver.expect(room, [room * 2, room * 2 + 1])
        assert sender.send(room, receiver.descriptor(), [5, 6], [room * 2, room * 2 + 1],
                           10).ok
    assert not sender.send(4, receiver.descriptor(), [5], [9], 10).ok  # unknown room
    assert len(sender._local.socks) == 1  # one connection served all four
    receiver.expect(5, [20])
    assert sender.send(5, receiver.descriptor(), [7], [20], 10).ok
    assert receiver.read_slots([20]) == sender.read_slots([7])
    desc = receiver.descriptor()
    receiver.close()
    result = sender.send(6, desc, [1], [1], 0.5)
    assert not result.ok and "no answer from decode" in result.error and result.seconds < 5
    assert sender._local.socks == {}  # closed, not kept
    again = ZmqBackend()
    again.register_buffers(pool(False))
    again.start()
    try:
        again.expect(7, [3])
        assert sender.send(7, again.descriptor(), [4], [3], 10).ok
        assert again.read_slots([3]) == sender.read_slots([4])
    finally:
        again.close()


def test_a_pool_of_another_shape_is_refused_before_sending(pair) -> None:
    sender, receiver = pair
    other = ZmqBackend()
    other.register_buffers(pool(False)[:4])
    result = sender.send(1, PeerDescriptor(receiver.endpoint(), other.buffer_infos()), [1], [1], 5)
    assert not result.ok and "KV buffers" in result.error


def test_peer_descriptor_from_the_wire_is_checked() -> None:
    for bad in (None, {}, {"endpoint": "", "buffers": []}, {"endpoint": "h:1", "buffers": [[1]]},
                {"endpoint": 3, "buffers": []}, {"endpoint": "h:1", "buffers": "x"}):
        with pytest.raises(KVTransferError):
            PeerDescriptor.from_wire(bad)


def test_flags_refuse_wrong_combinations() -> None:
    assert check_flags("null", "mooncake", 8998) is None
    assert check_flags("prefill", "zmq", 8998) is None
    assert "one of" in check_flags("both", "zmq", 8998)
    assert "one of" in check_flags("decode", "nccl", 8998)
    assert "1..65535" in check_flags("prefill", "zmq", 0)
    assert "embedding" in check_flags("decode", "zmq", 8998, is_embedding=True)
    assert "decode worker" in check_flags("prefill", "zmq", 8998, speculative_algorithm="NGRAM")
    assert check_flags("decode", "zmq", 8998, speculative_algorithm="NGRAM") is None


def test_bootstrap_server_checks_what_it_is_sent() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from sglang_admin.disaggregation.bootstrap_server import BootstrapServer

    async def run() -> None:
        boot = BootstrapServer("127.0.0.1", 0, 2)  # tp_size 1
        async with TestClient(TestServer(boot.app())) as client:
            assert (await client.get("/health")).status == 503
            assert (await client.get("/route")).status == 503
            for body in (b"nope", b"[]", b'{"dp_rank": 2, "rank_addr": "h:1"}',
                         b'{"dp_rank": true, "rank_addr": "h:1"}',
                         b'{"dp_rank": 0, "rank_addr": "nocolon"}', b'{"dp_rank": 0}'):
                resp = await client.put("/route", data=body)
                assert resp.status == 400, body
            assert (await client.put("/route", json={"dp_rank": 0, "rank_addr": "h:1"})).status == 200
            assert (await client.post("/register_dp_rank",
                                      json={"dp_rank": 1, "rank_addr": "h:2"})).status == 200
            assert (await client.get("/health")).status == 200
            table = await (await client.get("/route")).json()
            assert table == {"dp_size": 2, "tp_size": 1, "ranks": {"0": "h:1", "1": "h:2"}}
            one = await (await client.get("/route", params={"dp_rank": "1"})).json()
            assert one["rank_addr"] == "h:2"
            assert (await client.get("/route", params={"dp_rank": "x"})).status == 400
            assert (await client.get("/route", params={"dp_rank": "5"})).status == 404
            assert (await (await client.get("/query_dp_ranks")).json())["registered"] == [0, 1]

    asyncio.run(run())


@pytest.mark.parametrize("args, words", [
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nccl"], "one of"),
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "zmq",
      "--disaggregation-bootstrap-port", "70000"], "1..65535"),
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "zmq",
      "--speculative-algorithm", "NGRAM"], "decode worker"),
])
def test_a_wrong_combination_is_refused_at_start_with_one_line_and_exit_2(
        args: list[str], words: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "sglang_admin", "serve", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], done.stderr


def test_slot_run_is_one_run_of_consecutive_slots_only() -> None:
    from sglang_admin.disaggregation.transfer import slot_run

    assert slot_run([3, 4, 5]) == slice(3, 6)
    assert slot_run([7]) == slice(7, 8)
    for slots in ([], [3, 5, 4], [3, 4, 4, 6], [5, 4], [-1, 0, 1], [2, 4, 6]):
        assert slot_run(slots) is None, slots
    import numpy as np  # the other sequences a room's slots come as

    assert slot_run(range(4, 9)) == slice(4, 9) and slot_run(range(4, 12, 2)) is None
    assert slot_run(np.arange(2, 2050)) == slice(2, 2050)
    assert slot_run(np.array([1, 3, 2, 4])) is None
    assert slot_run([np.int64(5), np.int64(6)]) == slice(5, 7)
    assert slot_run(list(range(10, 2058))) == slice(10, 2058)
    assert slot_run([*range(10, 1000), 2000, *range(1001, 2058)]) is None


def test_staging_area_regions() -> None:
    from sglang_admin.disaggregation.staging import ALIGN, StagingArea

    area = StagingArea(4 * ALIGN)
    assert area.take("a", ALIGN + 1) == 0
    assert area.take("a", 10) is None  # one region per key
    assert area.take("b", ALIGN) == 2 * ALIGN  # aligned after a's end
    assert area.take("c", 2 * ALIGN) is None  # no room left
    assert area.take("d", 0) is None and area.take("e", 5 * ALIGN) is None
    area.give("a")
    area.give("a")  # idempotent
    assert area.take("c", 2 * ALIGN) == 0  # first fit in the freed space
    assert area.region("c") == (0, 2 * ALIGN) and area.region("a") is None
