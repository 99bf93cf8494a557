"""Small GGUF files written the way llama.cpp's converter writes them, for the tests.

A random Llama / Qwen2 / Qwen3 (2 layers) with a tiny byte-level BPE vocabulary and a ChatML
template in the metadata. Tensors go through the ``gguf`` package's writer and quantizer
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0); Q4_K blocks, which the package cannot write, are
packed here from the format's layout. Llama's q/k rows are permuted as llama.cpp does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sglang_admin.model.gguf_tokenizer import byte_alphabet

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a p", "Ġ w"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K"]


def vocabulary() -> list[str]:
    alphabet = byte_alphabet()
    return SPECIALS + [alphabet[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray,
              q: np.ndarray) -> np.ndarray:
    """Q4_K blocks (144 bytes per 256 values) from their parts: per block an fp16 scale d
    and min dmin, eight 6-bit sub-block scales sc and mins m, and 256 4-bit values q."""
    n = d.shape[0]
    out = np.zeros((n, 144), dtype=np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.astype(np.float16).reshape(n, 1).view(np.uint8)
    scales = np.zeros((n, 12), dtype=np.uint16)
    for j in range(4):
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    out[:, 4:16] = scales.astype(np.uint8)
    for i in range(4):
        low, high = q[:, 64 * i: 64 * i + 32], q[:, 64 * i + 32: 64 * i + 64]
        out[:, 16 + 32 * i: 16 + 32 * i + 32] = (low | (high << 4)).astype(np.uint8)
    return out


def q4_k_reference(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray,
                   q: np.ndarray) -> np.ndarray:
    """The values Q4_K blocks stand for: d * sc[j] * q - dmin * m[j] in sub-block j."""
    d32 = d.astype(np.float16).astype(np.float32)[:, None]
    dmin32 = dmin.astype(np.float16).astype(np.float32)[:, None]
    sub = np.repeat(np.arange(8), 32)
    return (d32 * sc[:, sub] * q - dmin32 * m[:, sub]).astype(np.float32)


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(blocks as uint8 [rows, cols/256*144], the float32 values they stand for), centred
    around zero so that they make a usable random model."""
    n = rows * cols // 256
    d = rng.uniform(0.004, 0.01, n).astype(np.float32)
    sc = rng.integers(1, 9, (n, 8)).astype(np.uint16)
    m = np.round(sc * 7.5).astype(np.uint16)  # up to 60: the mins' high bits are used
    q = rng.integers(0, 16, (n, 256)).astype(np.uint16)
    blocks = pack_q4_k(d, d, sc, m, q).reshape(rows, -1)
    return blocks, q4_k_reference(d, d, sc, m, q).reshape(rows, cols)


def write_gguf(path: Path, *, arch: str = "llama", qtype: str = "F32", tied: bool = False,
               seed: int = 0, hidden: int | None = None, name: str = "tiny",
               tokenizer: bool = True, v_qtype: str | None = None) -> Path:
    """Write a random 2-layer model of ``arch`` with its 2-D weights in ``qtype`` (``attn_v``
    in ``v_qtype`` when given: q/k/v of mixed types, as Q4_K_M files have)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    # transformers reads no head_dim from a qwen3 GGUF: it takes Qwen3's default of 128
    hidden = hidden or (512 if arch == "qwen3" else 256 if qtype.endswith("_K") else 64)
    heads, kv_heads, layers = 4, 2, 2
    head_dim = hidden // heads
    inter = 2 * hidden
    vocab = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(vocab)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.15).astype(np.float32)

    def add(name: str, values: np.ndarray, *, permute_heads: int = 0,
            as_type: str | None = None) -> None:
        qt = as_type or qtype
        if values.ndim == 1:
            w.add_tensor(name, values.astype(np.float32))
            return
        if qt.endswith("_K"):
            blocks, values = random_q4_k(*values.shape, rng)
            if permute_heads:  # llama.cpp permutes before quantizing: rows move whole
                blocks = llama_permute(blocks, permute_heads)
            w.add_tensor(name, blocks, raw_dtype=T.Q4_K)
            return
        if permute_heads:
            values = llama_permute(values, permute_heads)
        if qt == "F32":
            w.add_tensor(name, values)
        elif qt == "F16":
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, quantize(values, T[qt]), raw_dtype=T[qt])

    permute = arch == "llama"
    add("token_embd.weight", matrix(len(vocab), hidden))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add(p + "attn_q.weight", matrix(heads * head_dim, hidden), permute_heads=heads * permute)
        add(p + "attn_k.weight", matrix(kv_heads * head_dim, hidden),
            permute_heads=kv_heads * permute)
        add(p + "attn_v.weight", matrix(kv_heads * head_dim, hidden), as_type=v_qtype)
        if arch == "qwen2":
            for proj, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                add(p + f"attn_{proj}.bias", 0.1 * rng.standard_normal(size * head_dim))
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(head_dim))
            add(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(head_dim))
        add(p + "attn_output.weight", matrix(hidden, heads * head_dim))
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add(p + "ffn_gate.weight", matrix(inter, hidden))
        add(p + "ffn_up.weight", matrix(inter, hidden))
        add(p + "ffn_down.weight", matrix(hidden, inter))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    if not tied:
        add("output.weight", matrix(len(vocab), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def argmax_tokens(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers model, EOS not treated specially (as ignore_eos)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]
