"""What the CPU can do, read once: torch's vector capability and the `/proc/cpuinfo` flags that
decide which precision runs natively (engine_service/machine/precision.py chooses from them).

torch dispatches its own kernels by `torch.backends.cpu.get_cpu_capability()` ("AVX512", "AVX2",
"DEFAULT", ...; lowered by the ATEN_CPU_CAPABILITY variable), and oneDNN, which runs its matmuls,
by the instruction sets the CPU reports (lowered by ONEDNN_MAX_CPU_ISA). bfloat16 arithmetic is
native only with `avx512_bf16` or AMX (`amx_bf16`); elsewhere each bfloat16 matmul is converted
to float32 and back, several times slower than float32 itself.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that decide anything here, in the order they are reported.
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# ONEDNN_MAX_CPU_ISA values (oneDNN's names, lower case) that still include bfloat16 instructions
ONEDNN_BF16_ISAS = ("avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx", "avx512_core_amx_fp16", "all")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str  # "Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...
    capability: str  # torch's
    flags: frozenset[str]  # those of FLAGS the CPU reports
    onednn_max_isa: str = ""  # ONEDNN_MAX_CPU_ISA when set

    @property
    def native_bf16(self) -> bool:
        """bfloat16 matmuls run on bfloat16 instructions: the CPU has them, and neither torch's
        dispatch nor oneDNN's has been lowered below AVX-512."""
        if not self.flags & BF16_FLAGS or not self.capability.startswith("AVX512"):
            return False
        return not self.onednn_max_isa or self.onednn_max_isa.lower() in ONEDNN_BF16_ISAS

    @property
    def int8_dot(self) -> bool:
        """8-bit integer dot products that accumulate in 32 bits (AVX-512 VNNI, or AMX), which
        fbgemm's kernels use for 8-bit activations of the full range; without them (plain AVX2)
        its pairwise 16-bit sums can saturate unless activations are cut to 7 bits."""
        return bool(self.flags & {"avx512_vnni", "amx_int8"})

    @property
    def amx(self) -> bool:
        return self.native_bf16 and "amx_bf16" in self.flags

    @property
    def kind(self) -> str:
        """The class of machine the precision table is keyed on: amx, avx512_bf16, avx512, avx2, other."""
        if self.amx:
            return "amx"
        if self.native_bf16:
            return "avx512_bf16"
        if self.capability.startswith("AVX512"):
            return "avx512"
        if self.capability == "AVX2":
            return "avx2"
        return "other"

    def describe(self) -> str:
        """One line for logs and ServerInfo: torch's capability, the flags, the model name."""
        flags = " ".join(f for f in FLAGS if f in self.flags)
        isa = f" ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.capability} [{flags}]{isa} ({self.model_name})"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's model name and those of FLAGS it reports, from /proc/cpuinfo's text."""
    name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split()) & frozenset(FLAGS)
    return name, flags


@functools.cache
def detect() -> CpuInfo:
    """This machine's CpuInfo (read once; torch is imported here)."""
    import torch

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags, so nothing is assumed native
        text = ""
    name, flags = parse_cpuinfo(text)
    return CpuInfo(model_name=name or platform.processor() or platform.machine(),
                   capability=torch.backends.cpu.get_cpu_capability(), flags=flags,
                   onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
