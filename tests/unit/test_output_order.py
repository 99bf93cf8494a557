"""A step's outputs reach their calls with new requests first, each request's in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sglang_admin.config import ServerArgs
from sglang_admin.messages import ReqOutput
from sglang_admin.server.communicator import Communicator, _Stream
from sglang_admin.server.stream_buffer import OutputBuffer


def test_a_new_requests_first_output_is_taken_ahead_of_the_steps_other_streams(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        comm = Communicator(ServerArgs(ipc_dir=str(tmp_path)))
        try:
            streams = {
                "old-a~0": _Stream(0, OutputBuffer(100), "old-a~0", heard=True),
                "old-b~1": _Stream(0, OutputBuffer(100), "old-b~1", heard=True),
                "new~2": _Stream(0, OutputBuffer(100), "new~2"),
            }
            comm.by_wire_id.update(streams)
            woken: list[str] = []

            async def read(wire_id: str) -> ReqOutput:
                out = await streams[wire_id].buffer.get()
                woken.append(wire_id)
                assert isinstance(out, ReqOutput)
                return out

            readers = [asyncio.create_task(read(w)) for w in streams]
            await asyncio.sleep(0)  # every reader waits
            comm._file_outputs([  # a mixed step: decodes first, the new prefill last
                ReqOutput("old-a~0", [5], 3, 8, 0),
                ReqOutput("old-b~1", [6], 3, 4, 0),
                ReqOutput("new~2", [7], 3, 1, 0),
                ReqOutput("new~2", [], 3, 1, 0, finish_reason="abort"),
                ReqOutput("gone~9", [1], 3, 1, 0),  # a call that ended: dropped
            ])
            outs = await asyncio.gather(*readers)
            assert woken == ["new~2", "old-a~0", "old-b~1"]
            new = outs[2]  # its two outputs, in order, taken as one
            assert new.new_token_ids == [7] and new.finish_reason == "abort"
            assert streams["new~2"].heard
        finally:
            await comm.close()

    asyncio.run(go())
