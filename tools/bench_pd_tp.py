#!/usr/bin/env python
"""One room's KV transfer at --tp-size 2 against the same room at --tp-size 1, side by side
in one run, on CPU over loopback with the zmq backend.

tp 1: this process holds a prefill pool and a decode pool of the whole KV (every KV head)
and runs, per room, what the two legs' rank 0 run: decode's ``expect``, prefill's ``send``
and checksum (``send_checked``), decode's ``received_checksum`` and ``release``.

tp 2: this process is TP rank 0 and a spawned process TP rank 1 of one gloo group (the TP
group's real wire, disaggregation/tp_shards.py's real commands); each holds a prefill and a
decode pool of half the KV heads. Per room rank 0 runs both legs' rank 0 work as in PD:
decode ``expect`` + ``pd-expect`` (the followers' descriptors gathered), prefill
``pd-send`` and its own send beside the follower's, ``pd-results`` until the follower's
outcome is in, decode's checksum + ``pd-checksum`` and ``release`` + ``pd-release``. (In a
real pair each leg has its own group; here one group carries both legs' commands, in the
same number.) Every room's bytes are checked (each rank's checksums equal).

Each figure is the median of the rounds' per-room times; the TP commands' own share is
timed apart (the collectives alone, not the sends), and so is one bare broadcast + gather
round of the group, for scale. The ratio tp 2 / tp 1 is printed beside.

Usage: python tools/bench_pd_tp.py [--tokens 32 512] [--layers 4] [--heads 2]
       [--head-dim 32] [--rounds 20] [--json FILE]
Defaults are the embedded test model's float32 KV: 4 layers x 2 KV heads x 32 dims.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang_admin.disaggregation.prefill import SHARD_QUERY_INTERVAL_S  # noqa: E402
from sglang_admin.disaggregation.tp_shards import (  # noqa: E402
    PD_CHECKSUM,
    PD_EXPECT,
    PD_RELEASE,
    FollowerShards,
    LeaderShards,
)
from sglang_admin.disaggregation.zmq_backend import ZmqBackend  # noqa: E402
from sglang_admin.model.tensor_parallel import TensorParallel  # noqa: E402

SLOTS = 4096
STOP = "bench-stop"
DECODE_COMMANDS = (PD_EXPECT, PD_CHECKSUM, PD_RELEASE)


def _pool(layers: int, heads: int, head_dim: int, fill: bool, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, SLOTS, heads, head_dim)
    kv = torch.randn(shape, generator=gen) if fill else torch.zeros(shape)
    return [kv[i, j] for j in range(2) for i in range(layers)]


def _started(pool: list[torch.Tensor]) -> ZmqBackend:
    backend = ZmqBackend()
    backend.register_buffers(pool)
    backend.start()
    return backend


def _join(rank: int, port: int) -> TensorParallel:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    return TensorParallel(rank, 2, dist.group.WORLD, torch.device("cpu"))


def _follower(port: int, layers: int, heads: int, head_dim: int) -> None:
    """TP rank 1: a prefill shard and a decode shard, each a FollowerShards; the decode
    leg's commands go to the decode one, the prefill leg's to the prefill one."""
    torch.set_num_threads(1)
    tp = _join(1, port)
    ppool = _pool(layers, heads // 2, head_dim, True, 2)
    dpool = _pool(layers, heads // 2, head_dim, False, 3)
    prefill = FollowerShards(ZmqBackend(), lambda: ppool, 1)
    decode = FollowerShards(ZmqBackend(), lambda: dpool, 1)
    try:
        while True:
            command = tp.broadcast()
            if command[0] == STOP:
                return
            (decode if command[0] in DECODE_COMMANDS else prefill).handle(command, tp.gather)
    finally:
        prefill.close()
        decode.close()
        dist.destroy_process_group()


def _room_tp1(p: ZmqBackend, d: ZmqBackend, room: int, src: list[int], dst: list[int]
              ) -> tuple[float, float]:
    t0 = time.perf_counter()
    d.expect(room, dst)
    result = p.send_checked(room, d.descriptor(), src, dst, 30)  # as prefill's send thread
    sent = result.checksum
    got = d.received_checksum(room, dst)  # as decode on prefill's "done"
    d.release(room)
    took = time.perf_counter() - t0
    assert result.ok and sent == got, result.error or "checksum"
    return took, 0.0


def _room_tp2(p: ZmqBackend, d: ZmqBackend, shards: LeaderShards, room: int, src: list[int],
              dst: list[int]) -> tuple[float, float]:
    """One room over both TP ranks; (its time, the TP commands' share of it)."""
    tp_time = 0.0
    t0 = time.perf_counter()
    d.expect(room, dst)
    c = time.perf_counter()
    followers = shards.expect(room, dst)
    peers = [d.descriptor().to_wire(), *followers]
    shards.send(room, peers, src, dst, 30.0)
    tp_time += time.perf_counter() - c
    result = p.send_checked(room, d.descriptor(), src, dst, 30)
    sent = result.checksum
    outcome = None
    while True:  # as PrefillRooms asks: again after SHARD_QUERY_INTERVAL_S
        c = time.perf_counter()
        outcome = shards.results([room])[0].get(room)
        tp_time += time.perf_counter() - c
        if outcome is not None:
            break
        time.sleep(SHARD_QUERY_INTERVAL_S)
    got = d.received_checksum(room, dst)
    c = time.perf_counter()
    theirs = shards.checksums(dst, room)
    shards.release(room)
    tp_time += time.perf_counter() - c
    d.release(room)
    took = time.perf_counter() - t0
    assert result.ok and outcome[0], result.error or outcome[1]
    assert sent == got and theirs == [outcome[4]], "checksum"
    return took, tp_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2, help="KV heads (even)")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_follower,
                                           args=(port, a.layers, a.heads, a.head_dim))
    proc.start()
    tp = _join(0, port)
    shards = LeaderShards(tp)
    whole_p = _started(_pool(a.layers, a.heads, a.head_dim, True, 0))
    whole_d = _started(_pool(a.layers, a.heads, a.head_dim, False, 1))
    half_p = _started(_pool(a.layers, a.heads // 2, a.head_dim, True, 4))
    half_d = _started(_pool(a.layers, a.heads // 2, a.head_dim, False, 5))
    rows: list[dict[str, Any]] = []
    room = 0
    try:
        for n in a.tokens:
            src, dst = list(range(1, n + 1)), list(range(SLOTS - n, SLOTS))
            t1, t2, share, bare = [], [], [], []
            for _ in range(a.rounds):  # alternated: the machine may be shared and noisy
                room += 1
                t1.append(_room_tp1(whole_p, whole_d, room, src, dst)[0])
                room += 1
                took, tp_time = _room_tp2(half_p, half_d, shards, room, src, dst)
                t2.append(took)
                share.append(tp_time)
                c = time.perf_counter()
                shards.checksums([], 0)  # one bare broadcast + gather round, for scale
                bare.append(time.perf_counter() - c)
            row = {"tokens": n, "kv_bytes": n * a.layers * 2 * a.heads * a.head_dim * 4,
                   "tp1_ms": statistics.median(t1) * 1000,
                   "tp2_ms": statistics.median(t2) * 1000,
                   "tp2_commands_ms": statistics.median(share) * 1000,
                   "one_round_ms": statistics.median(bare) * 1000}
            row["ratio"] = row["tp2_ms"] / row["tp1_ms"]
            rows.append(row)
            print(f"{n:6d} tokens ({row['kv_bytes'] / 1e6:.2f} MB): tp 2 {row['tp2_ms']:.2f} ms "
                  f"(of which TP commands {row['tp2_commands_ms']:.2f} ms; one bare broadcast "
                  f"+ gather round {row['one_round_ms']:.2f} ms) / tp 1 "
                  f"{row['tp1_ms']:.2f} ms = {row['ratio']:.2f}x", flush=True)
    finally:
        tp.broadcast((STOP,))
        proc.join(30)
        for b in (whole_p, whole_d, half_p, half_d):
            b.close()
        dist.destroy_process_group()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
