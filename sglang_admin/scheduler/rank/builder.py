"""What a rank is built from, before its loop runs: the model runner (and its TP replica),
the batching policy with its grammar queue and speculative settings, and the LoRA slots."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from sglang_admin.config import ServerArgs
from sglang_admin.messages import ModelInfo
from sglang_admin.model.lora import LoraAdapterError, LoraBuffers, read_adapter, served_config
from sglang_admin.scheduler.grammar import GrammarQueue, XGrammarBackend
from sglang_admin.scheduler.lora_registry import LoraRegistry
from sglang_admin.scheduler.scheduler import Scheduler, SchedulerConfig
from sglang_admin.scheduler.speculative.setup import spec_config
from sglang_admin.scheduler.stop_strings import stop_string_detokenizer

if TYPE_CHECKING:
    from sglang_admin.model.runner import ModelRunner

logger = logging.getLogger(__name__)


def grammar_queue_for(args: ServerArgs, info: ModelInfo) -> GrammarQueue:
    """The compile pool and cache of constrained decoding, against the served tokenizer."""
    directory = args.tokenizer_path or info.tokenizer_path
    tokenizer_file = os.path.join(directory, "tokenizer.json") if directory else None
    if tokenizer_file is not None and not os.path.isfile(tokenizer_file):
        tokenizer_file = None
    backend = XGrammarBackend(tokenizer_file, info.vocab_size, tuple(info.eos_token_ids))
    # xgrammar is imported by the rank's late-imports thread once it is ready
    # (scheduler/late_imports.py); a compile waits for it
    return GrammarQueue.for_backend(backend)


def build_runner(args: ServerArgs, rank: int) -> tuple[ModelRunner, ModelRunner, Any]:
    """The rank's model: (the runner its loop steps, the target model's own runner, the TP
    replica or None). At --tp-size > 1 this rank is TP rank 0 and its loop steps a
    LeaderRunner that runs every TP rank's shard."""
    import torch

    from sglang_admin.model.runner import keep_freed_cpu_memory
    from sglang_admin.scheduler.tp.worker import build_runner as build_shard_runner

    # A core is left to the server by default: threads that share cores with it (or with
    # each other) spin-wait on one another and make every step many times slower.
    torch.set_num_threads(args.rank_threads)
    keep_freed_cpu_memory()
    torch.manual_seed(args.seed + rank)
    tensor_parallel = None  # --tp-size > 1: this rank is TP rank 0 of its replica
    if args.tp_size > 1:
        from sglang_admin.scheduler.tp.worker import join_replica

        tensor_parallel = join_replica(args, rank, 0)
    target = build_shard_runner(args, rank, 0, tensor_parallel)  # TP rank 0's
    runner = target
    if tensor_parallel is not None:
        from sglang_admin.scheduler.tp.worker import LeaderRunner

        tensor_parallel.barrier()  # every TP rank's shard is loaded
        runner = LeaderRunner(target, tensor_parallel)  # type: ignore[assignment]
    return runner, target, tensor_parallel


def build_scheduler(args: ServerArgs, runner: ModelRunner, on_kv_event: Any) -> Scheduler:
    """The rank's batching policy over the runner's KV pool (speculative settings, grammar
    queue, stop-string detokenizer)."""
    info = runner.info
    scheduler = Scheduler(
        SchedulerConfig(
            token_capacity=runner.token_capacity,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            context_length=info.context_length,
            eos_token_ids=tuple(info.eos_token_ids),
            pools_every_token=info.pooling in ("CLS", "MEAN"),
            preempt_wait_s=args.preempt_wait_s,
            speculative=spec_config(args),
        ),
        on_kv_event=on_kv_event,
        grammar_queue=grammar_queue_for(args, info),
    )
    scheduler.detokenize = stop_string_detokenizer(args.tokenizer_path, info.tokenizer_path)
    return scheduler


def setup_lora(args: ServerArgs, runner: ModelRunner, scheduler: Scheduler
               ) -> LoraRegistry | None:
    """With --enable-lora: the registry over the runner's slot buffers (allocated with the
    model, before the KV pool took the free memory) handed to the scheduler, and the
    --lora-paths adapters loaded (a bad one fails the start)."""
    buffers: LoraBuffers | None = runner.lora
    if not args.enable_lora or buffers is None:
        return None
    registry = LoraRegistry(args.max_loaded_loras, lambda a: buffers.clear(a.slot))
    scheduler.lora = registry
    for name, path in args.lora_paths:
        try:
            adapter = read_adapter(path, served_config(runner.model), args.max_lora_rank)
        except LoraAdapterError as exc:
            raise RuntimeError(f"--lora-paths {name}={path}: {exc}") from None
        slot, _ = registry.plan_load(name, name)
        buffers.write(slot, adapter)
        registry.add(name, name, path, False, slot)
    logger.info("LoRA enabled: %d slots of rank <= %d (%.1f MiB), %d adapter(s) loaded",
                args.max_loaded_loras, args.max_lora_rank, buffers.nbytes() / 2**20,
                len(args.lora_paths))
    return registry
