"""The multinode parts without a model: the TP group's wire (no pickle; fuzzed), the flag
checks and rank placement, and the nodes' link (join check, refusal, garbage, liveness)."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest

torch = pytest.importorskip("torch")

from sglang_admin.config import ServerArgs  # noqa: E402
from sglang_admin.messages import SamplingParams, StartProfileReq  # noqa: E402
from sglang_admin.model.lora import AdapterWeights  # noqa: E402
from sglang_admin.model.step_io import SeqInput  # noqa: E402
from sglang_admin.multinode import link as link_mod  # noqa: E402
from sglang_admin.multinode import wire  # noqa: E402
from sglang_admin.multinode.link import LinkError, NodeLink, first_difference  # noqa: E402
from sglang_admin.multinode.topology import (  # noqa: E402
    check_flags,
    local_tp_ranks,
    node_of,
    placement,
)


def _seq(**kw) -> SeqInput:
    return SeqInput(req_idx=1, prefix_len=4, token_ids=[7], table_start=4, table_slots=[9],
                    sampling=SamplingParams(temperature=0.7, top_k=5), prompt_ids=[1, 2, 3],
                    output_ids=[5], **kw)


def test_commands_round_trip_without_pickle() -> None:
    adapter = AdapterWeights(4, 0.5, ("q_proj", "o_proj"), {
        (0, "q_proj"): (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 4)),
        (1, "o_proj"): (torch.zeros(4, 0), torch.ones(2, 4, dtype=torch.float16))})
    commands = [
        ("step", [_seq(), _seq(draft=[3, 4], return_logprob=True, token_ids_logprob=[1])]),
        ("refit", "/x/y", None), ("lora-write", 2, adapter), ("stop",),
        ("profile-start", StartProfileReq("rid", "/tmp", "p1")),
        ("receive", ["a"], ["bfloat16"], [[2, 3]], "auto", 1.5),
        (True, "", torch.tensor(3.5)), {"k": [1, None, 2.5, b"\x00"]},
    ]
    for cmd in commands:
        data = wire.encode(cmd)
        assert b"\x80\x04" not in data[:2]  # not a pickle stream
        out = wire.decode(data)
        assert type(out) is type(cmd)
        if isinstance(cmd, dict):
            assert out == cmd
        elif cmd[0] == "lora-write":
            got = out[2]
            assert got.targets == adapter.targets and got.rank == 4
            for key, (a, b) in adapter.weights.items():
                assert torch.equal(got.weights[key][0], a) and got.weights[key][1].dtype == b.dtype
        elif cmd[0] == "step":
            assert out[1] == cmd[1] and out[1][0].sampling == cmd[1][0].sampling
        elif isinstance(cmd[-1], torch.Tensor):
            assert torch.equal(out[-1], cmd[-1])
        else:
            assert out == cmd


def test_values_that_do_not_travel_are_refused_when_sent() -> None:
    for bad in (object(), {1, 2}, torch.zeros(2, dtype=torch.complex64), lambda: 0):
        with pytest.raises(wire.WireError):
            wire.encode(("step", bad))


def test_fuzzed_bytes_decode_or_fail_as_wire_errors() -> None:
    rng = random.Random(5)
    good = wire.encode(("step", [_seq(), _seq()], (1, torch.arange(6).reshape(2, 3))))
    for i in range(3000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            buf = bytearray(good)
            for _ in range(rng.randrange(1, 6)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf[:rng.randrange(1, len(buf) + 1)])
        try:
            wire.decode(data)
        except wire.WireError:
            pass


def test_flag_checks_and_placement() -> None:
    ok = ServerArgs(nnodes=2, node_rank=1, tp_size=4, dp_size=2, dist_init_addr="10.0.0.1:5000")
    assert check_flags(ok) is None
    assert list(local_tp_ranks(ok)) == [2, 3] and node_of(ok, 1) == 0 and node_of(ok, 3) == 1
    assert [r["node_rank"] for r in placement(ok)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert "past 65535" in check_flags(ok.replace(dist_init_addr="h:65535"))
    assert check_flags(ok.replace(dist_init_addr="[::1]:5000")) is None
    for mode in ("prefill", "decode"):  # a PD worker is one host: refused in one line
        assert check_flags(ok.replace(disaggregation_mode=mode)).startswith(
            f"--disaggregation-mode {mode} with --nnodes 2 is not supported")
    assert check_flags(ok.replace(nnodes=1, node_rank=0, dist_init_addr="",
                                  disaggregation_mode="prefill")) is None


def _args(port: int, node: int, **kw) -> ServerArgs:
    return ServerArgs(nnodes=2, node_rank=node, tp_size=2, dist_init_addr=f"127.0.0.1:{port}",
                      dist_timeout_s=kw.pop("timeout", 10.0), **kw)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_link_joins_past_garbage_and_sees_a_node_go(monkeypatch) -> None:
    monkeypatch.setattr(link_mod, "SILENT_S", 1.0)
    monkeypatch.setattr(link_mod, "PING_S", 0.1)

    async def main() -> list[tuple[int, str]]:
        port = _port()
        leader, member = NodeLink(_args(port, 0)), NodeLink(_args(port, 1))
        joining = asyncio.ensure_future(leader.join())
        await asyncio.sleep(0.2)
        _, w = await asyncio.open_connection("127.0.0.1", port)  # garbage, then a huge frame
        w.write(b"\xff\xff\xff\xff" + b"x" * 64)
        _, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"\x00\x00\x00\x03\xc1\xc1\xc1")
        await member.join()
        await joining
        lost: list[tuple[int, str]] = []
        leader.watch(lambda node, why: lost.append((node, why)))
        member.watch(lambda node, why: None)
        await asyncio.sleep(0.5)
        assert lost == []
        for peer in member.peers.values():  # node 1 goes without a word
            peer.writer.transport.abort()
        for task in member._tasks:
            task.cancel()
        await asyncio.sleep(0.5)
        await leader.close(clean=True)
        return lost

    lost = asyncio.run(main())
    assert lost and lost[0][0] == 1 and "link closed" in lost[0][1]


def test_link_refuses_a_node_that_disagrees_on_both_ends() -> None:
    async def main() -> tuple[str, str]:
        port = _port()
        leader = NodeLink(_args(port, 0, dtype="float32"))
        member = NodeLink(_args(port, 1, dtype="bfloat16"))
        results = await asyncio.gather(leader.join(), member.join(), return_exceptions=True)
        assert all(isinstance(r, LinkError) for r in results), results
        return str(results[0]), str(results[1])

    mine, theirs = asyncio.run(main())
    assert mine == theirs == ("node 1 disagrees with node 0 on dtype: node 0 has 'float32', "
                              "node 1 has 'bfloat16'")
    assert first_difference({"dtype": "a"}, {"dtype": "a"}, 1) is None


def test_link_bounded_wait_for_node_0() -> None:
    async def main() -> str:
        member = NodeLink(_args(_port(), 1, timeout=1.0))
        with pytest.raises(LinkError) as err:
            await member.join()
        return str(err.value)

    assert "node 0 is not reachable at --dist-init-addr 127.0.0.1:" in asyncio.run(main())


def test_link_counts_a_silent_node_gone(monkeypatch) -> None:
    monkeypatch.setattr(link_mod, "SILENT_S", 1.0)
    monkeypatch.setattr(link_mod, "PING_S", 0.1)

    async def main() -> list[tuple[int, str]]:
        port = _port()
        leader = NodeLink(_args(port, 0, watchdog_probe_timeout_s=1.0))
        member = NodeLink(_args(port, 1, watchdog_probe_timeout_s=1.0))
        await asyncio.gather(leader.join(), member.join())
        lost: list[tuple[int, str]] = []
        leader.watch(lambda node, why: lost.append((node, why)))
        member.watch(lambda node, why: None)
        await asyncio.sleep(0.5)
        assert lost == []
        for task in member._tasks:  # node 1 freezes: its connection stays open, silent
            task.cancel()
        await asyncio.sleep(2.0)
        await leader.close(clean=True)
        await member.close(clean=False)
        return lost

    lost = asyncio.run(main())
    assert lost and lost[0][0] == 1 and "silent for 1s" in lost[0][1]
