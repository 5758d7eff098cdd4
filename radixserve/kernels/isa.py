"""The CPU's instruction-set tier: the one place that says which SIMD the CPU kernels may use.

Every choice that depends on the CPU (the flags the C kernels are built with, which linear
implementation packs the weights, whether bf16 prefill attention is ours or torch's, what
`--dtype auto` picks) asks `selected_tier()`; nothing probes by catching an exception.

Tiers, each including the ones before it:

- `portable`: no ISA flags at all; plain C the compiler vectorises for the architecture's
  baseline (SSE2 on x86-64, NEON on aarch64). Every machine has it.
- `avx2`: AVX2 + FMA + F16C (Intel since Haswell, AMD since Zen 1).
- `avx512`: AVX-512 F/BW/VL/DQ (Intel Skylake-SP and later servers, AMD Zen 4).
- `avx512_bf16`: plus AVX-512 BF16, the bf16 pair dot product, and AVX512-VNNI, the int8 and
  int16 dot products (Intel Cooper Lake, Sapphire Rapids; AMD Zen 4: each has both).
- `amx`: plus AMX tiles for bf16 (Intel Sapphire Rapids and later). radixserve's kernels use no
  AMX instruction; torch's oneDNN does, so on this tier bf16 matmuls stay with torch.

`RADIXSERVE_CPU_ISA=<tier>` forces a lower tier than the machine has (a higher one is an error
naming the machine's), so one machine runs and tests every tier it supports. It also caps
torch's own kernels to that tier (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`,
`MKL_ENABLE_INSTRUCTIONS`, each unless set already): with the cap oneDNN refuses bf16 packing
below AVX-512 exactly as it does on an AVX2-only CPU, so the forced tier behaves like such a
machine, torch included. torch reads these at its first use of those kernels, so the tier must
be selected (this module's `selected_tier()`) before the first matmul; the server, the
benchmarks and the test suite do so at start-up.
"""

from __future__ import annotations

import enum
import functools
import os
import platform
from pathlib import Path

OVERRIDE_ENV = "RADIXSERVE_CPU_ISA"


class Tier(enum.IntEnum):
    """ISA tiers in increasing order: a machine of one tier can run every lower one."""

    PORTABLE = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_BF16 = 3
    AMX = 4

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Tier:
        try:
            return cls[name.strip().upper()]
        except KeyError:
            names = ", ".join(str(t) for t in cls)
            raise ValueError(f"unknown CPU ISA tier {name!r}: expected one of {names}") from None


# /proc/cpuinfo flags a tier needs beyond the tier below it
_REQUIRED_FLAGS: dict[Tier, tuple[str, ...]] = {
    Tier.AVX2: ("avx2", "fma", "f16c"),
    Tier.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    Tier.AVX512_BF16: ("avx512_bf16", "avx512_vnni"),
    Tier.AMX: ("amx_tile", "amx_bf16"),
}

# gcc/clang flags a tier adds to the kernel build (x86-64 only; other architectures build the
# portable tier with no ISA flags)
_COMPILE_FLAGS: dict[Tier, tuple[str, ...]] = {
    Tier.AVX2: ("-mavx2", "-mfma", "-mf16c"),
    Tier.AVX512: ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"),
    Tier.AVX512_BF16: ("-mavx512bf16", "-mavx512vnni"),
    Tier.AMX: (),  # the kernels use no AMX instruction: the avx512_bf16 build serves
}

# torch's own caps for a forced tier: ATen's vectorised kernels, oneDNN's and MKL's instruction sets
_TORCH_CAPS: dict[Tier, dict[str, str]] = {
    Tier.PORTABLE: {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    Tier.AVX2: {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    Tier.AVX512: {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    Tier.AVX512_BF16: {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"},  # E3: AVX-512 with bf16, no AMX
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def machine_tier() -> Tier:
    """The highest tier this CPU supports."""
    if not _is_x86():
        return Tier.PORTABLE
    flags, tier = cpu_flags(), Tier.PORTABLE
    for candidate in list(Tier)[1:]:
        if not all(flag in flags for flag in _REQUIRED_FLAGS[candidate]):
            break
        tier = candidate
    return tier


@functools.cache
def selected_tier() -> Tier:
    """The tier in use: the machine's, or the lower one RADIXSERVE_CPU_ISA asks for (which also
    caps torch's kernels; see the module docstring). Read once per process."""
    wanted = os.environ.get(OVERRIDE_ENV, "").strip()
    machine = machine_tier()
    if not wanted:
        return machine
    tier = Tier.parse(wanted)
    if tier > machine:
        raise ValueError(f"{OVERRIDE_ENV}={tier} asks for more than this CPU has: its tier is {machine} "
                         f"(flags needed for {tier}: {' '.join(_needed_flags(tier))})")
    if tier < machine:
        for name, value in _TORCH_CAPS[tier].items():
            os.environ.setdefault(name, value)
    return tier


def at_least(tier: Tier) -> bool:
    """Whether the tier in use includes `tier`."""
    return selected_tier() >= tier


def compile_flags(tier: Tier) -> list[str]:
    """The ISA flags the kernels are built with for `tier` on this architecture."""
    if not _is_x86():
        return []
    return [flag for t in Tier if Tier.PORTABLE < t <= tier for flag in _COMPILE_FLAGS[t]]


def _needed_flags(tier: Tier) -> list[str]:
    return [flag for t in Tier if Tier.PORTABLE < t <= tier for flag in _REQUIRED_FLAGS[t]]
