"""The CPU ISA tier (radixserve/kernels/isa.py): read from the CPU's flags, forced lower by
RADIXSERVE_CPU_ISA (never higher), the flags each tier builds with, and a kernel library built
for every tier the machine supports."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa
from radixserve.kernels.isa import Tier

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx"
ZEN3 = f"{BASE} avx2 fma f16c bmi2"
ZEN4 = f"{ZEN3} avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = f"{ZEN4} amx_tile amx_bf16 amx_int8"
AARCH64_CC = "aarch64-linux-gnu-gcc"


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given /proc/cpuinfo flags on the given architecture."""

    # a forced tier writes torch's caps into os.environ (setdefault). Record each one's state
    # with monkeypatch so that teardown puts it back: `delenv` of an absent name records nothing,
    # hence setenv first. A leaked ONEDNN_MAX_CPU_ISA made later bf16 servers of this test
    # process refuse to pack their weights.
    for name in {n for caps in isa._TORCH_CAPS.values() for n in caps}:
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)

    def pretend(flags: str, machine: str = "x86_64") -> None:
        monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags.split()))
        monkeypatch.setattr(isa.platform, "machine", lambda: machine)
        isa.machine_tier.cache_clear()
        isa.selected_tier.cache_clear()

    yield pretend
    isa.machine_tier.cache_clear()
    isa.selected_tier.cache_clear()


@pytest.mark.parametrize(("flags", "tier"), [
    (BASE, Tier.PORTABLE),
    ("avx2 fma", Tier.PORTABLE),  # no F16C: not the avx2 tier
    (ZEN3, Tier.AVX2),
    (f"{ZEN3} avx512f avx512bw avx512vl", Tier.AVX2),  # no DQ
    (f"{ZEN3} avx512f avx512bw avx512vl avx512dq", Tier.AVX512),
    (ZEN4, Tier.AVX512_BF16),
    (SAPPHIRE_RAPIDS, Tier.AMX),
    (f"{ZEN3} amx_tile amx_bf16", Tier.AVX2),  # tiers include the ones below them
])
def test_machine_tier_from_the_cpu_flags(cpu, monkeypatch, flags, tier):
    monkeypatch.delenv(isa.OVERRIDE_ENV, raising=False)
    cpu(flags)
    assert isa.machine_tier() == tier == isa.selected_tier()


def test_other_architectures_are_portable(cpu, monkeypatch):
    monkeypatch.delenv(isa.OVERRIDE_ENV, raising=False)
    cpu("fp asimd sve", machine="aarch64")
    assert isa.machine_tier() == Tier.PORTABLE
    assert isa.compile_flags(Tier.PORTABLE) == []


def test_override_forces_a_lower_tier_and_caps_torch(cpu, monkeypatch):
    cpu(SAPPHIRE_RAPIDS)
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(isa.OVERRIDE_ENV, "AVX2")  # any case
    assert isa.selected_tier() == Tier.AVX2 and isa.at_least(Tier.AVX2) and not isa.at_least(Tier.AVX512)
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert isa.machine_tier() == Tier.AMX


def test_override_keeps_caps_the_user_set(cpu, monkeypatch):
    cpu(SAPPHIRE_RAPIDS)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    monkeypatch.setenv(isa.OVERRIDE_ENV, "avx2")
    isa.selected_tier()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"


def test_override_of_the_machines_own_tier_changes_nothing_in_torch(cpu, monkeypatch):
    cpu(ZEN4)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(isa.OVERRIDE_ENV, "avx512_bf16")
    assert isa.selected_tier() == Tier.AVX512_BF16
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ


def test_override_above_the_machine_is_an_error_naming_its_tier(cpu, monkeypatch):
    cpu(ZEN3)
    monkeypatch.setenv(isa.OVERRIDE_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match=r"its tier is avx2 .*avx512f .*avx512_bf16"):
        isa.selected_tier()


def test_unknown_override_is_an_error_listing_the_tiers(cpu, monkeypatch):
    cpu(ZEN3)
    monkeypatch.setenv(isa.OVERRIDE_ENV, "sse9")
    with pytest.raises(ValueError, match="portable, avx2, avx512, avx512_bf16, amx"):
        isa.selected_tier()


def test_a_bad_override_stops_the_server_before_it_starts(cpu, monkeypatch):
    from radixserve.config import ServerConfig
    from radixserve.launch import Backend, StartupError

    cpu(ZEN3)
    monkeypatch.setenv(isa.OVERRIDE_ENV, "amx")
    with pytest.raises(StartupError, match="RADIXSERVE_CPU_ISA=amx asks for more than this CPU has"):
        Backend(ServerConfig(model="default"))


def test_compile_flags_accumulate_by_tier(cpu):
    cpu(SAPPHIRE_RAPIDS)
    assert isa.compile_flags(Tier.PORTABLE) == []
    assert isa.compile_flags(Tier.AVX2) == ["-mavx2", "-mfma", "-mf16c"]
    avx512 = isa.compile_flags(Tier.AVX512)
    assert avx512[:3] == ["-mavx2", "-mfma", "-mf16c"] and "-mavx512bw" in avx512 and "-mavx512bf16" not in avx512
    assert isa.compile_flags(Tier.AVX512_BF16) == [*avx512, "-mavx512bf16", "-mavx512vnni"] == isa.compile_flags(Tier.AMX)


def test_the_kernels_build_for_every_tier_the_machine_supports(cpu_tier):
    lib = cpu_kernels.load_library()
    if lib is None:
        pytest.skip("no C compiler on this machine")
    assert lib is cpu_kernels.load_library(cpu_tier)
    # the fp32 panel linear serves at every tier; bf16 from avx2 up (widened, or as pairs)
    assert lib.linear_serves(0) and bool(lib.linear_serves(1)) == (cpu_tier >= Tier.AVX2)


@pytest.mark.skipif(shutil.which(AARCH64_CC) is None, reason=f"no {AARCH64_CC} (Debian's gcc-aarch64-linux-gnu; .ci/run installs it)")
@pytest.mark.parametrize("source", sorted(p.name for p in cpu_kernels.SOURCE_DIR.glob("*.c")))
def test_the_portable_sources_compile_for_aarch64(tmp_path, source):
    """ARM machines get the portable tier: every source must compile there, with no x86
    intrinsic outside its guarded block."""
    subprocess.run([AARCH64_CC, *cpu_kernels.COMPILE_FLAGS, "-Werror", "-c", str(cpu_kernels.SOURCE_DIR / source),
                    "-o", str(tmp_path / "out.o")], check=True, capture_output=True, text=True)
