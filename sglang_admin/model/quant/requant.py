"""Write a GGUF file whose projections are re-quantized to another type (Q8_0, Q4_0, ...)
from a source file's dequantized values, the rest copied as is: test and quality inputs
of each kept type, made with the ``gguf`` package's writer and quantizers (Q4_K, Q6_K:
model/quant/kquants.py; a tensor whose inputs are not whole 256-blocks takes
``K_FALLBACK``'s type instead, as llama.cpp does on such shapes)."""

from __future__ import annotations

import numpy as np

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "output", "token_embd")
K_FALLBACK = {"Q4_K": "Q4_1", "Q6_K": "Q8_0"}


def _quantize(values: np.ndarray, type_name: str) -> tuple[np.ndarray, str]:
    """(the bytes, the type written) of float [N, K] ``values`` as ``type_name``."""
    from gguf import GGMLQuantizationType, quants

    from sglang_admin.model.quant.kquants import SUPER, quantize_q4_k, quantize_q6_k

    if type_name in K_FALLBACK:
        if values.shape[1] % SUPER:
            type_name = K_FALLBACK[type_name]
        else:
            kq = quantize_q4_k if type_name == "Q4_K" else quantize_q6_k
            return kq(values), type_name
    return quants.quantize(values, GGMLQuantizationType[type_name]), type_name


def requantize_gguf(source: str, target: str, type_name: str) -> None:
    """Copy ``source`` to ``target`` with every projection (and the embedding / output
    matrix) dequantized and quantized again as ``type_name``."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(source, "r")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        kind = tensor.name.split(".")[-2]
        data = np.asarray(tensor.data)
        if kind in _PROJECTIONS or tensor.name == "token_embd.weight":
            shape = [int(d) for d in reversed(tensor.shape.tolist())]
            values = np.asarray(quants.dequantize(data, tensor.tensor_type),
                                dtype=np.float32).reshape(shape)
            packed, written = _quantize(values, type_name)
            writer.add_tensor(tensor.name, packed, raw_shape=packed.shape,
                              raw_dtype=gguf.GGMLQuantizationType[written])
        else:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape,
                              raw_dtype=gguf.GGMLQuantizationType(int(tensor.tensor_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
