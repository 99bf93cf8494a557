"""Weights kept quantized on CPU: GGUF blocks repacked at load for torch's int4/int8 matmul
kernels (:mod:`.gguf_blocks`, :mod:`.linear`, :mod:`.gguf_load`); docs/gguf.md says which
GGUF types are kept and which are dequantized."""
