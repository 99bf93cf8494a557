"""Write a GGUF file whose projections are re-quantized to another type (Q8_0, Q4_0, ...)
from a source file's dequantized values, the rest copied as is: test and quality inputs
of each kept type, made with the ``gguf`` package's writer and quantizers."""

from __future__ import annotations

import numpy as np

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "output", "token_embd")


def requantize_gguf(source: str, target: str, type_name: str) -> None:
    """Copy ``source`` to ``target`` with every projection (and the embedding / output
    matrix) dequantized and quantized again as ``type_name``."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[type_name]
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
            packed = quants.quantize(values, qtype)
            writer.add_tensor(tensor.name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape,
                              raw_dtype=gguf.GGMLQuantizationType(int(tensor.tensor_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
