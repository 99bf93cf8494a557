"""``--dtype auto`` on CPU (model/cpu_dtype.py): bfloat16 only for a half-precision checkpoint
or a quantized GGUF on a CPU with native bfloat16, with the reason its start line prints;
explicit dtypes are taken as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.cpu_dtype import (
    auto_cpu_choice,
    auto_cpu_dtype,
    choose_dtype,
    cpu_flags,
    cpu_has_native_bf16,
    gguf_weight_type,
)
from sglang_admin.model.runner import resolve_dtype

SAPPHIRE = frozenset({"sse4_2", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
COOPER = frozenset({"avx2", "avx512f", "avx512_bf16"})
SKYLAKE = frozenset({"sse4_2", "avx2", "avx512f", "avx512bw"})  # AVX-512, no BF16


@pytest.mark.parametrize("flags", [SAPPHIRE, COOPER])
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
def test_half_checkpoint_on_native_bf16_cpu_is_bfloat16(flags, checkpoint) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert auto_cpu_dtype(checkpoint, flags) == torch.bfloat16


@pytest.mark.parametrize("flags", [SAPPHIRE, SKYLAKE, frozenset()])
def test_float32_checkpoint_stays_float32(flags) -> None:
    assert auto_cpu_dtype("float32", flags) == torch.float32


@pytest.mark.parametrize("flags", [SKYLAKE, frozenset()])
def test_without_native_bf16_a_half_checkpoint_runs_in_float32(flags) -> None:
    assert not cpu_has_native_bf16(flags)
    assert auto_cpu_dtype("bfloat16", flags) == torch.float32


@pytest.mark.parametrize("flags", [SAPPHIRE, COOPER])
@pytest.mark.parametrize("weights", ["Q4_1", "Q8_0", "Q4_K", "F16", "BF16"])
def test_quantized_gguf_on_native_bf16_cpu_is_bfloat16(flags, weights) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    # the converted checkpoint stores float32 (dequantized); its source weights decide
    choice = auto_cpu_choice("float32", weights, flags)
    assert choice.dtype == torch.bfloat16
    assert f"{weights} GGUF weights" in choice.reason and "native bfloat16" in choice.reason
    assert "avx512_bf16" in choice.reason


@pytest.mark.parametrize("flags", [SKYLAKE, frozenset()])
def test_quantized_gguf_without_native_bf16_is_float32(flags) -> None:
    choice = auto_cpu_choice("float32", "Q4_1", flags)
    assert choice.dtype == torch.float32
    assert "emulated" in choice.reason and "no avx512_bf16 or amx_bf16" in choice.reason


@pytest.mark.parametrize("flags", [SAPPHIRE, SKYLAKE])
def test_full_precision_gguf_stays_float32(flags) -> None:
    choice = auto_cpu_choice("float32", "F32", flags)
    assert choice.dtype == torch.float32 and "F32 GGUF weights" in choice.reason


def test_the_reason_names_the_checkpoint_and_the_cpu() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert auto_cpu_choice("bfloat16", "", SAPPHIRE).reason == (
        "a bfloat16 checkpoint and a CPU with native bfloat16 (amx_bf16, avx512_bf16)")
    assert auto_cpu_choice("float32", "", SAPPHIRE).reason.startswith("a float32 checkpoint: ")
    cpu = torch.device("cpu")
    assert choose_dtype("bfloat16", cpu, "float32").reason == "--dtype bfloat16"
    assert choose_dtype("auto", cpu, "float32").reason.startswith("--dtype auto: a float32")


def test_the_weight_type_is_read_from_a_converted_config(tmp_path: Path) -> None:
    import json

    for value, want in (("Q4_1", "Q4_1"), ("BF16", "BF16"), (None, ""), (4, ""),
                        (["Q4_1"], ""), ("Q4 1; rm", "")):
        (tmp_path / "config.json").write_text(json.dumps(
            {"torch_dtype": "float32"} | ({} if value is None else {"gguf_weight_type": value})))
        assert gguf_weight_type(str(tmp_path)) == want, value


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_resolve_dtype_on_cpu() -> None:
    cpu = torch.device("cpu")
    native = cpu_has_native_bf16()
    assert resolve_dtype("auto", cpu, "float32") == torch.float32
    assert resolve_dtype("auto", cpu, "bfloat16") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", cpu, "float16") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", cpu, "float32", "Q4_1") == (
        torch.bfloat16 if native else torch.float32)
    # an explicit dtype is taken as given, whatever the CPU
    assert resolve_dtype("bfloat16", cpu, "float32") == torch.bfloat16
    assert resolve_dtype("float32", cpu, "bfloat16") == torch.float32
