"""A flush's KV events and its answer: with a live subscriber, the events are filed first
(it reads "cleared" before the answer leaves); with none, the answer goes first (the call
waiting for it resumes before the events are filed) and the events are filed right after
it, every rank's in arrival order."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sglang_admin.config import ServerArgs
from sglang_admin.messages import AdminReply, KvEvents
from sglang_admin.server.communicator import Communicator, _AdminCall


def _stored(node: int) -> list:
    """A radix node of 16 new tokens (a full KV block) under the root."""
    return ["stored", node, None, [node] * 16]


def test_kv_events_wait_for_the_answer_only_while_nobody_subscribes(tmp_path: Path) -> None:
    async def go() -> None:
        comm = Communicator(ServerArgs(ipc_dir=str(tmp_path)))
        comm.start()
        hub = comm.kv_hub
        try:
            base = hub.ranks[0].seq
            call = comm.calls["admin-1"] = _AdminCall((0,), asyncio.get_running_loop())
            seen_by_caller: list[int] = []

            async def caller() -> None:  # the flush's call, waiting for its answer
                await call.done
                seen_by_caller.append(hub.ranks[0].seq)

            waiting = asyncio.ensure_future(caller())
            await asyncio.sleep(0)  # it waits
            comm._dispatch(KvEvents(0, [["cleared"]]))  # a flush's parts, in the rank's order
            comm._dispatch(AdminReply("admin-1", 0, True, "Cache flushed successfully"))
            assert call.done.done() and hub.ranks[0].seq == base  # the answer first
            comm._dispatch(KvEvents(0, [_stored(7)]))  # later events queue behind
            sub = hub.subscribe(0)  # a subscriber arrives while two wait
            comm._dispatch(KvEvents(0, [_stored(8)]))  # ... and still queue behind them
            assert hub.ranks[0].seq == base
            await waiting
            assert seen_by_caller == [base]  # the caller resumed before the events were filed
            await asyncio.sleep(0)
            assert hub.ranks[0].seq == base + 3
            # it subscribed before any of the three was filed: it reads all three, in order
            kinds = [[e.WhichOneof("data") for e in sub.queue.get_nowait().events]
                     for _ in range(3)]
            assert kinds == [["cleared"], ["stored"], ["stored"]]
            # with a subscriber and nothing waiting: filed at once, ahead of the answer
            comm.calls["admin-2"] = _AdminCall((0,), asyncio.get_running_loop())
            comm._dispatch(KvEvents(0, [["cleared"]]))
            assert hub.ranks[0].seq == base + 4
            assert sub.queue.get_nowait().events[0].WhichOneof("data") == "cleared"
        finally:
            await comm.close()

    asyncio.run(go())
