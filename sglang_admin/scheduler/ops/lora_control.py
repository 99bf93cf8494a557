"""Rank-side LoRA: the adapter slots set up at start, and the Load / Unload / List handlers.

Load reads and checks the PEFT adapter (model/lora.py), evicts the least recently used
unpinned idle adapter when every slot is taken, and writes the weights into the slot.
Unload answers once no request uses the adapter any more (scheduler/lora_registry.py).
Failures carry the gRPC status code that fits in ``LoraResult.error_code``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from sglang_admin.constants import LORA_NOT_ENABLED
from sglang_admin.messages import (
    ListLoraReq,
    LoadLoraReq,
    LoraAdapterInfo,
    LoraResult,
    UnloadLoraReq,
)
from sglang_admin.model.lora import LoraAdapterError, read_adapter, served_config
from sglang_admin.scheduler.lora_registry import Adapter, LoraRegistry
from sglang_admin.scheduler.ops.registry import handles

if TYPE_CHECKING:
    from sglang_admin.scheduler.rank.loop import Rank

logger = logging.getLogger(__name__)



def _infos(registry: LoraRegistry) -> list[LoraAdapterInfo]:
    return [LoraAdapterInfo(a.lora_id, a.lora_name, a.lora_path, a.pinned)
            for a in registry.adapters()]


def _fail(rank: Rank, msg: Any, text: str, code: str) -> None:
    registry = getattr(rank, "lora", None)
    infos = _infos(registry) if registry is not None else []
    rank.reply(msg, False, text, LoraResult(infos, error_code=code))


@handles(LoadLoraReq)
def on_load(rank: Rank, msg: LoadLoraReq) -> None:
    registry: LoraRegistry | None = getattr(rank, "lora", None)
    if registry is None:
        _fail(rank, msg, LORA_NOT_ENABLED, "FAILED_PRECONDITION")
        return
    try:
        slot, evict = registry.plan_load(msg.lora_id, msg.lora_name, msg.pinned)
    except ValueError as exc:
        code = "ALREADY_EXISTS" if "already loaded" in str(exc) else "RESOURCE_EXHAUSTED"
        _fail(rank, msg, str(exc), code)
        return
    try:
        weights = read_adapter(msg.lora_path, served_config(rank.runner.model),
                               rank.args.max_lora_rank)
    except LoraAdapterError as exc:
        _fail(rank, msg, f"adapter {msg.lora_name!r} at {msg.lora_path}: {exc}",
              "INVALID_ARGUMENT")
        return
    registry.evict(evict)
    buffers = rank.runner.lora
    assert buffers is not None
    buffers.write(slot, weights)
    registry.add(msg.lora_id, msg.lora_name, msg.lora_path, msg.pinned, slot)
    evicted = [a.lora_id for a in evict]
    text = f"loaded LoRA adapter {msg.lora_name!r} as {msg.lora_id!r} (rank {weights.rank})"
    if evicted:
        text += f"; evicted {', '.join(evicted)} (least recently used)"
    logger.info(text)
    rank.publish_state(force=True)
    rank.reply(msg, True, text, LoraResult(_infos(registry), evicted))


@handles(UnloadLoraReq)
def on_unload(rank: Rank, msg: UnloadLoraReq) -> None:
    registry: LoraRegistry | None = getattr(rank, "lora", None)
    if registry is None:
        _fail(rank, msg, LORA_NOT_ENABLED, "FAILED_PRECONDITION")
        return
    adapter = registry.find(msg.lora_id, msg.lora_name)
    if adapter is None:
        which = f"lora_id {msg.lora_id!r}" if msg.lora_id else f"lora_name {msg.lora_name!r}"
        _fail(rank, msg, f"no LoRA adapter with {which} is loaded", "NOT_FOUND")
        return
    done: Future = Future()

    def unloaded(fut: Future) -> None:
        gone: Adapter = fut.result()
        logger.info("unloaded LoRA adapter %r", gone.lora_id)
        done.set_result((True, f"unloaded LoRA adapter {gone.lora_id!r}",
                         LoraResult(_infos(registry))))

    if adapter.users:
        logger.info("unload of LoRA adapter %r waits for %d request(s)", adapter.lora_id,
                    adapter.users)
    registry.unload(adapter).add_done_callback(unloaded)
    rank.publish_state(force=True)
    rank.reply_when_done(msg, done)


@handles(ListLoraReq)
def on_list(rank: Rank, msg: ListLoraReq) -> None:
    registry: LoraRegistry | None = getattr(rank, "lora", None)
    if registry is None:
        _fail(rank, msg, LORA_NOT_ENABLED, "FAILED_PRECONDITION")
        return
    rank.reply(msg, True, "", LoraResult(_infos(registry)))
