"""A trainer process as RL frameworks run one: a transformers Qwen2 model, a few optimizer
steps, then its weights pushed to a worker. Run by tests/integration/test_weight_sync.py.

Modes (argv[1]):
  sglang  join with SGLang's helper (copied below, as verl/slime/OpenRLHF copy it), push every
          parameter one broadcast each; then, on "next" from stdin, Destroy the group, train
          more, and push again through our WeightPusher into a new group; then, on "next",
          train more and push through shared memory.
  die     join with SGLang's helper, start an update of every parameter, broadcast half of
          them, print "half", then SIGKILL itself on "next".
  sglang-then-die
          sglang's three pushes; then, once its helper's group is destroyed, print "done"
          and, on "die" from stdin, go on as die (a group of its own, argv[7] its port):
          one trainer process (torch and transformers imported once) for both.

After each push it saves the trained model to OUT/<phase> (the test compares the worker with
transformers on it) and prints "pushed <phase>".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

import grpc
import torch
import torch.distributed as dist
import transformers
from packaging.version import Version

from sglang_admin.client.trainer import WeightPusher
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc


# ---- SGLang's helper (python/sglang/srt/utils: init_custom_process_group), as copied into
# trainers: a TCPStore rendezvous, a PrefixStore named by the group, a new group.
def init_custom_process_group(backend: str | None = None, init_method: str | None = None,
                              timeout: timedelta | None = None, world_size: int = -1,
                              rank: int = -1, store: Any = None, group_name: str | None = None,
                              pg_options: Any = None) -> Any:
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    # (SGLang compares version strings; parsed here, or torch 2.10+ reads as older than 2.6)
    pg_options_param_name = ("backend_options" if Version(torch.__version__) >= Version("2.6")
                             else "pg_options")
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name,
        **{pg_options_param_name: pg_options}, timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def train(model: Any, steps: int, seed: int) -> None:
    """A few AdamW steps of language modelling on random tokens."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(2, model.config.vocab_size, (4, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def save(model: Any, out: str, phase: str) -> None:
    model.save_pretrained(os.path.join(out, phase), safe_serialization=True)
    print(f"pushed {phase}", flush=True)


def sglang_join(stub: pb_grpc.SglangSchedulerStub, port: int, world: int, group: str) -> Any:
    """What a framework's rollout manager does: the HTTP/RPC call in a thread, its own join."""
    answer: dict = {}

    def call() -> None:
        answer["resp"] = stub.InitWeightsUpdateGroup(pb.InitWeightsUpdateGroupRequest(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world,
            group_name=group, backend="gloo"), timeout=120)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                   timeout=timedelta(seconds=120), world_size=world, rank=0,
                                   group_name=group)
    t.join()
    assert answer["resp"].success, answer["resp"].message
    return pg


def sglang_push(stub: pb_grpc.SglangSchedulerStub, model: Any, pg: Any, group: str,
                version: str, kill_after: int | None = None) -> None:
    """update_weights_from_distributed as the frameworks call it: every name at once, then
    one broadcast per tensor in that order."""
    params = list(model.named_parameters())
    answer: dict = {}

    def call() -> None:
        try:
            answer["resp"] = stub.UpdateWeightsFromDistributed(
                pb.UpdateWeightsFromDistributedRequest(
                    names=[n for n, _ in params],
                    dtypes=[str(p.dtype).removeprefix("torch.") for _, p in params],
                    shapes=[pb.TensorShape(dims=list(p.shape)) for _, p in params],
                    group_name=group, weight_version=version), timeout=120)
        except grpc.RpcError as exc:
            answer["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    for k, (_, p) in enumerate(params):
        if kill_after is not None and k == kill_after:
            print("half", flush=True)  # the worker is mid-receive until we hear "next"
            sys.stdin.readline()
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.broadcast(p.data, src=0, group=pg)
    t.join()
    assert "resp" in answer and answer["resp"].success, answer
    assert answer["resp"].weight_version == version


def main() -> None:
    mode, target, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    port = int(sys.argv[5])
    # the helper's group gets a port of its own: port + 1 may be any process's ephemeral port
    helper_port = int(sys.argv[6])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(target))
    world = 3  # the trainer and a dp 2 worker
    train(model, 3, seed=1)
    if mode == "die":
        die(stub, model, port, world)
        return
    pg = sglang_join(stub, port, world, "sglang-group")
    sglang_push(stub, model, pg, "sglang-group", "sglang-1")
    save(model, out, "sglang")
    sys.stdin.readline()

    # Destroy, then a new group through our helper.
    resp = stub.DestroyWeightsUpdateGroup(
        pb.DestroyWeightsUpdateGroupRequest(group_name="sglang-group"), timeout=60)
    assert resp.success, resp.message
    dist.destroy_process_group(pg)
    train(model, 2, seed=2)
    pusher = WeightPusher([target], timeout_s=120, bucket_bytes=64 << 10, flatten=True)
    pusher.join("127.0.0.1", helper_port, group_name="helper-group")
    pusher.push(model.named_parameters(), weight_version="helper-2")
    save(model, out, "helper")
    sys.stdin.readline()

    train(model, 2, seed=3)
    pusher.flatten = False  # (the default: one broadcast per tensor, one call per bucket)
    pusher.push(model.named_parameters(), weight_version="helper-2b")
    pusher.push_shared(model.named_parameters(), weight_version="shm-3")
    save(model, out, "shm")
    pusher.destroy()
    if mode == "sglang-then-die":
        print("done", flush=True)
        if sys.stdin.readline().strip() == "die":
            die(stub, model, int(sys.argv[7]), world)


def die(stub: pb_grpc.SglangSchedulerStub, model: Any, port: int, world: int) -> None:
    """Join "die-group", start an update of every parameter and broadcast half of them;
    print "half", then SIGKILL this process on "next"."""
    pg = sglang_join(stub, port, world, "die-group")
    half = len(list(model.parameters())) // 2
    sglang_push(stub, model, pg, "die-group", "never", kill_after=half)


if __name__ == "__main__":
    main()
