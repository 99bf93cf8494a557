"""``--dtype auto`` on CPU (model/cpu_dtype.py): bfloat16 only for a half-precision checkpoint
on a CPU with native bfloat16; explicit dtypes are taken as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_admin.model.cpu_dtype import auto_cpu_dtype, cpu_flags, cpu_has_native_bf16
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
    # an explicit dtype is taken as given, whatever the CPU
    assert resolve_dtype("bfloat16", cpu, "float32") == torch.bfloat16
    assert resolve_dtype("float32", cpu, "bfloat16") == torch.float32
