"""Q4_K and Q6_K blocks written from float values (the ``gguf`` package reads them but cannot
write them): plain min/max (Q4_K) and absmax (Q6_K) quantizers over the formats' layouts,
for quality inputs of those types (model/quant/requant.py). Not llama.cpp's searched scales:
the values they stand for are what matters here, as the reference is the file's own
dequantized values."""

from __future__ import annotations

import numpy as np

SUPER = 256  # values per K-quant block


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q4_K bytes [N, K / 256 * 144]: per block an
    fp16 scale d and min dmin, eight 6-bit sub-block scales and mins, 256 4-bit values;
    ``w = d * sc[j] * q - dmin * m[j]`` in sub-block j of 32."""
    n, k = values.shape
    x = np.asarray(values, dtype=np.float32).reshape(-1, 8, 32)  # [B, 8, 32]
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / 15.0  # [B, 8]
    d = _fp16(step.max(-1) / 63.0)  # [B]
    dmin = _fp16((-lo).max(-1) / 63.0)
    safe_d, safe_dmin = np.where(d > 0, d, 1.0), np.where(dmin > 0, dmin, 1.0)
    sc = np.clip(np.rint(step / safe_d[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / safe_dmin[:, None]), 0, 63).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    q = np.rint((x + (dmin[:, None] * m)[..., None]) / np.where(scale > 0, scale, 1.0))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, SUPER)
    out = np.zeros((q.shape[0], 144), dtype=np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.astype(np.float16).reshape(-1, 1).view(np.uint8)
    for j in range(4):
        out[:, 4 + j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, 8 + j] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, 12 + j] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    for c in range(4):
        low, high = q[:, 64 * c: 64 * c + 32], q[:, 64 * c + 32: 64 * c + 64]
        out[:, 16 + 32 * c: 48 + 32 * c] = low | (high << 4)
    return out.reshape(n, k // SUPER * 144)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q6_K bytes [N, K / 256 * 210]: per block 128
    bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 sub-block scales and an fp16
    d; ``w = d * sc[j] * (q - 32)`` in sub-block j of 16."""
    n, k = values.shape
    x = np.asarray(values, dtype=np.float32).reshape(-1, 16, 16)  # [B, 16, 16]
    step = np.abs(x).max(-1) / 31.0  # [B, 16]
    d = _fp16(step.max(-1) / 127.0)
    sc = np.clip(np.rint(step / np.where(d > 0, d, 1.0)[:, None]), -128, 127).astype(np.int8)
    scale = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.rint(x / np.where(scale > 0, scale, 1.0))
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, SUPER)
    out = np.zeros((u.shape[0], 210), dtype=np.uint8)
    for h in range(2):  # two halves of 128 values
        v = [u[:, 128 * h + 32 * t: 128 * h + 32 * t + 32] for t in range(4)]
        out[:, 64 * h: 64 * h + 32] = (v[0] & 0xF) | ((v[2] & 0xF) << 4)
        out[:, 64 * h + 32: 64 * h + 64] = (v[1] & 0xF) | ((v[3] & 0xF) << 4)
        out[:, 128 + 32 * h: 160 + 32 * h] = ((v[0] >> 4) | ((v[1] >> 4) << 2)
                                              | ((v[2] >> 4) << 4) | ((v[3] >> 4) << 6))
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return out.reshape(n, k // SUPER * 210)
