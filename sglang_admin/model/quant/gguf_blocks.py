"""GGUF quantized blocks turned into what torch's CPU matmul kernels take, in numpy.

Four outcomes per tensor type (:func:`plan_for`):

- **int4 in groups of 32** (``INT4_TYPES``: Q4_0, Q4_1, Q4_K) kept exactly as stored: 4-bit
  values 0..15 and, per 32 inputs, a scale and a zero with ``w = (q - 8) * scale + zero``
  (Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m``; Q4_K: ``d * sc * q - dmin * m`` per
  sub-block of 32); the scales and zeros are rounded to the served dtype by the kernel's
  layout (bfloat16: 8 bits of mantissa).
- **int8 in blocks of 32** (``INT8_BLOCK_TYPES``: Q8_0) kept exactly as stored: int8
  values and one scale per 32 inputs, ``w = q * d`` (:class:`Int8Blocks`); served as two
  4-bit halves of each value (:func:`nibble_halves`) through the int4 kernel.
- **int8 per output row** (``INT8_TYPES``: Q6_K, whose scales are per 16 inputs, a group
  the int4 kernel does not take) requantized: the stored blocks are dequantized and each
  row quantized again symmetrically with one scale (what ``_weight_int8pack_mm`` takes); a
  rounding of its own, measured in docs/gguf.md.
- **dense** (every other type: F32, F16, BF16, Q5_*, Q2_K, Q3_K, Q5_K, the IQ types ...):
  dequantized to the served dtype, as the dequantizing load does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_BLOCK_TYPES = ("Q8_0",)
INT8_TYPES = ("Q6_K",)


@dataclass
class Int4Groups:
    """A [N, K] weight as 4-bit values and per-32-input scales and zeros (float32 here)."""

    q: np.ndarray  # uint8 [N, K], values 0..15
    scale: np.ndarray  # float32 [N, K / group]
    zero: np.ndarray  # float32 [N, K / group]
    group: int = GROUP  # inputs per scale and zero (GGUF: 32)

    def take_rows(self, order: np.ndarray) -> Int4Groups:
        """The same weight with its rows reordered."""
        return Int4Groups(self.q[order], self.scale[order], self.zero[order], self.group)


@dataclass
class Int8Rows:
    """A [N, K] weight as int8 values and one scale per row: ``w = q * scale``."""

    q: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N]

    def take_rows(self, order: np.ndarray) -> Int8Rows:
        """The same weight with its rows reordered."""
        return Int8Rows(self.q[order], self.scale[order])


@dataclass
class Int8Blocks:
    """A [N, K] weight as int8 values and one scale per 32 inputs: ``w = q * scale``
    (GGUF's Q8_0 as stored)."""

    q: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N, K / 32]

    def take_rows(self, order: np.ndarray) -> Int8Blocks:
        """The same weight with its rows reordered."""
        return Int8Blocks(self.q[order], self.scale[order])


def plan_for(type_name: str) -> str:
    """"int4", "int8x32" (int8 blocks of 32), "int8" (per row) or "dense": how a tensor of
    GGML type ``type_name`` is served."""
    if type_name in INT4_TYPES:
        return "int4"
    if type_name in INT8_BLOCK_TYPES:
        return "int8x32"
    if type_name in INT8_TYPES:
        return "int8"
    return "dense"


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """uint8 values 0..15 from bytes [B, n * chunk]: per chunk of bytes, the low nibbles
    then the high ones (llama.cpp's order in Q4_0, Q4_1 and Q4_K)."""
    b = qs.shape[0]
    split = qs.reshape(b, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(b, -1)


def _q4k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and mins per block from its 12 packed bytes."""
    b = packed.shape[0]
    s = packed.reshape(b, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def int4_groups(raw: np.ndarray, type_name: str, n: int, k: int) -> Int4Groups:
    """Q4_0 / Q4_1 / Q4_K bytes of a [n, k] tensor (rows of blocks) as :class:`Int4Groups`."""
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if type_name == "Q4_0":
        blocks = raw.reshape(-1, 18)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        q = _nibbles(blocks[:, 2:], 16)
        scale, zero = d, np.zeros_like(d)
    elif type_name == "Q4_1":
        blocks = raw.reshape(-1, 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = _nibbles(blocks[:, 4:], 16)
        scale, zero = d, m + 8 * d
    elif type_name == "Q4_K":
        blocks = raw.reshape(-1, 144)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = _q4k_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], 32)
        scale = d * sc  # [B, 8]
        zero = 8 * scale - dmin * mn
    else:
        raise ValueError(f"{type_name} is not a 4-bit type kept as int4")
    return Int4Groups(q.reshape(n, k), scale.reshape(n, k // GROUP).astype(np.float32),
                      zero.reshape(n, k // GROUP).astype(np.float32))


def int8_blocks(raw: np.ndarray, n: int, k: int) -> Int8Blocks:
    """Q8_0 bytes of a [n, k] tensor (per block an fp16 scale and 32 int8 values) as
    :class:`Int8Blocks`."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    q = blocks[:, 2:].copy().view(np.int8)
    return Int8Blocks(q.reshape(n, k), d.reshape(n, k // GROUP))


def nibble_halves(w: Int8Blocks) -> Int4Groups:
    """The same weight as 4-bit groups over twice the inputs, for the int4 kernel on the
    input repeated twice ``[x, x]``: with ``u = q + 128 = 16 h + l`` (h, l in 0..15),
    ``q * d = (h - 8) * 16 d + (l - 8) * d + 8 d``: the high nibbles (scale 16 d, zero 0)
    in the first K inputs, the low ones (scale d, zero 8 d) in the next K. Exact."""
    u = w.q.astype(np.int16) + 128
    high, low = (u >> 4).astype(np.uint8), (u & 0x0F).astype(np.uint8)
    s = w.scale.astype(np.float32)
    return Int4Groups(np.concatenate([high, low], axis=1),
                      np.concatenate([16 * s, s], axis=1),
                      np.concatenate([np.zeros_like(s), 8 * s], axis=1))


def dequantize_int8_blocks(w: Int8Blocks) -> np.ndarray:
    """float32 [N, K] of an :class:`Int8Blocks` weight."""
    n, k = w.q.shape
    return (w.q.reshape(n, k // GROUP, GROUP).astype(np.float32)
            * w.scale[..., None]).reshape(n, k)


def int8_rows(values: np.ndarray) -> Int8Rows:
    """A float [N, K] weight quantized symmetrically per row to int8."""
    values = np.asarray(values, dtype=np.float32)
    amax = np.abs(values).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(values / scale[:, None]), -127, 127).astype(np.int8)
    return Int8Rows(q, scale)


def dequantize_int4(w: Int4Groups) -> np.ndarray:
    """float32 [N, K] of an :class:`Int4Groups` weight (exact up to float32 rounding)."""
    n, k = w.q.shape
    q = w.q.reshape(n, k // w.group, w.group).astype(np.float32)
    return ((q - 8) * w.scale[..., None] + w.zero[..., None]).reshape(n, k)


def int4_quantize(values: np.ndarray, group: int) -> Int4Groups:
    """A float [N, K] weight quantized to 4 bits per ``group`` inputs, asymmetric (the
    group's min and max span 0..15): torchao's int4 weight-only scheme."""
    values = np.asarray(values, dtype=np.float32)
    n, k = values.shape
    g = values.reshape(n, k // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Int4Groups(q.reshape(n, k), scale, (lo + 8 * scale).astype(np.float32), group)
