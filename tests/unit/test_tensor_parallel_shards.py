"""model/tensor_parallel.py's cut of checkpoint tensors and configs (no process group)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_admin.model.config import LlamaConfig  # noqa: E402
from sglang_admin.model.tensor_parallel import TensorParallel, TensorParallelError  # noqa: E402


def config(heads: int = 4, kv: int = 2, inter: int = 128) -> LlamaConfig:
    return LlamaConfig("LlamaForCausalLM", "llama", vocab_size=32, hidden_size=64,
                       intermediate_size=inter, num_layers=1, num_heads=heads,
                       num_kv_heads=kv, head_dim=16)


def tp(rank: int, size: int, cfg: LlamaConfig) -> TensorParallel:
    return TensorParallel(rank, size, None, torch.device("cpu"), cfg)


def test_shards_concatenate_to_the_full_tensors() -> None:
    cfg = config()
    q = torch.randn(64, 64)
    o = torch.randn(64, 64)
    down = torch.randn(64, 128)
    ranks = [tp(r, 2, cfg) for r in range(2)]
    name = "model.layers.0.{}.weight"
    assert torch.equal(torch.cat([t.shard(name.format("self_attn.q_proj"), q) for t in ranks]), q)
    assert torch.equal(torch.cat([t.shard(name.format("self_attn.o_proj"), o) for t in ranks], 1), o)
    assert torch.equal(torch.cat([t.shard(name.format("mlp.down_proj"), down) for t in ranks], 1),
                       down)
    bias = torch.randn(64)
    cut = [t.shard("model.layers.0.self_attn.o_proj.bias", bias) for t in ranks]
    assert torch.equal(cut[0], bias) and not cut[1].any()  # summed once
    embed = torch.randn(32, 64)
    assert ranks[1].shard("model.embed_tokens.weight", embed) is embed  # replicated


def test_kv_heads_replicated_when_ranks_outnumber_them() -> None:
    cfg = config(heads=8, kv=2)
    k = torch.arange(2 * 16).float().view(32, 1).expand(32, 4)
    cuts = [tp(r, 4, cfg).shard("model.layers.0.self_attn.k_proj.weight", k) for r in range(4)]
    # ranks 0, 1 hold q heads 0-3 (KV head 0); ranks 2, 3 hold q heads 4-7 (KV head 1)
    assert [int(c[0, 0]) // 16 for c in cuts] == [0, 0, 1, 1]
    assert all(c.shape == (16, 4) for c in cuts)
    sharded = tp(3, 4, cfg).shard_config()
    assert (sharded.num_heads, sharded.num_kv_heads, sharded.intermediate_size) == (2, 1, 32)


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(TensorParallelError, match="attention heads"):
        tp(0, 3, config()).shard_config()
    with pytest.raises(TensorParallelError, match="KV heads"):
        tp(0, 4, config(heads=12, kv=3, inter=128)).shard_config()


@pytest.mark.parametrize(("heads", "kv", "size"), [(4, 2, 2), (4, 1, 2), (8, 2, 4)],
                         ids=["kv-split", "kv-replicated", "tp4-kv-replicated"])
def test_unshard_inverts_shard_and_full_shape_names_the_whole(heads: int, kv: int,
                                                              size: int) -> None:
    """GetWeightsByName joins the shards back (a replicated KV head counted once); a
    trainer's manifest is checked against the full shapes each rank receives."""
    cfg = config(heads=heads, kv=kv)
    ranks = [tp(r, size, cfg) for r in range(size)]
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(heads * 16, 64),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * 16, 64),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(kv * 16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, heads * 16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128),
        "model.layers.0.mlp.down_proj.bias": torch.randn(64),
        "model.embed_tokens.weight": torch.randn(32, 64),
        "model.layers.0.input_layernorm.weight": torch.randn(64),
    }
    for name, whole in full.items():
        shards = [t.shard(name, whole) for t in ranks]
        assert torch.equal(ranks[0].unshard(name, shards), whole), name
        for t, shard in zip(ranks, shards):
            assert t.full_shape(name, tuple(shard.shape)) == tuple(whole.shape), name
    assert not ranks[0].is_split("model.embed_tokens.weight")
    assert ranks[0].is_split("model.layers.0.mlp.down_proj.bias")
