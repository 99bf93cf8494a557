"""A worker whose SubscribeKvEvents streams can be cut on demand, for the resume tests.

``python tests/kv_stream_cut.py serve ARGS`` runs ``sglang-admin serve ARGS`` unchanged but
for one thing: when the file named by ``KV_STREAM_CUT`` exists and holds a rank number, the
next stream to send an event batch of that rank ends right after it with UNAVAILABLE (a
dropped connection as the gateway sees it) and the file is removed. Test code only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator

import grpc

from sglang_admin.pb import common_pb2 as pb
from sglang_admin.server import info_service
from sglang_admin.server.errors import Serialized, ServiceError


def _batch(item: pb.KvEventBatch | Serialized) -> pb.KvEventBatch:
    return item if isinstance(item, pb.KvEventBatch) else pb.KvEventBatch.FromString(item.data)


def _take_cut(trigger: str, rank: int) -> bool:
    """Whether the trigger file names ``rank`` (then it is removed: one cut per write)."""
    try:
        with open(trigger) as f:
            named = f.read().strip()
    except FileNotFoundError:
        return False
    if named != str(rank):
        return False
    os.unlink(trigger)
    return True


def _cutting(stream):
    async def kv_events(self, request, context) -> AsyncIterator[pb.KvEventBatch | Serialized]:
        trigger = os.environ["KV_STREAM_CUT"]
        async for item in stream(self, request, context):
            yield item
            batch = _batch(item)
            if batch.events and _take_cut(trigger, batch.dp_rank):
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "stream cut by the test")
    return kv_events


if __name__ == "__main__":
    info_service.Info.kv_events = _cutting(info_service.Info.kv_events)
    from sglang_admin.cli import main

    sys.exit(main(sys.argv[1:]))
