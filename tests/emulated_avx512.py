"""The kernels' AVX-512 tiers tested on a CPU without AVX-512: SIMDe-emulated builds of the
avx512 and avx512_bf16 tiers, for `pytest --emulate-avx512` (`make test-emulated`).

The kernels choose their AVX-512 paths at compile time, and the suite runs each tier only where
the CPU has it (the `cpu_tier` fixture). So a change to an AVX-512 path made on an AVX2-only CPU
(Zen 3) is compiled but never run until a session gets an AVX-512 machine. SIMDe (the simde-py
package, headers only) implements the AVX-512 intrinsics in portable C. Each source of
radixserve/kernels/csrc is rewritten for it: the `_mm512_*` intrinsics (and the masked
`_mm256_*` ones) and the `__m512*` / `__mmask*` types take SIMDe's names, and the `__AVX512*__`
guards become macros this build defines. The rewritten sources compile with the AVX2 tier's
flags into one library per emulated tier. `install` then makes `cpu.load_library` return those
libraries for those tiers and reports avx512_bf16 as the machine's tier, so the `cpu_tier`
tests run the AVX-512 tiers as if the CPU had them.

What a pass shows: the AVX-512 code computes what the tests assert (the references within their
tolerances, rows alone bit-identical to rows in a batch). What it does not show: speed
(emulation is far slower), or AMX (no kernel uses an AMX instruction: the amx tier's build is
avx512_bf16's).

Caveats:
- SIMDe's fp32 arithmetic (fma, dpbf16, reductions) rounds as written, not as the hardware does;
  the tests' tolerances cover that.
- emulated_avx512_shims.h has the intrinsics SIMDe lacks, and masked loads and stores: SIMDe's
  read and write every lane (zeros where the mask is clear), past the end of a row.
- quant_linear.c compiles at -O1: at -O2 gcc 12 takes over 15 minutes on its unrolled emulated
  code. The rest compile at -O2, since gcc 12 at -O1 miscompiles paged_decode.c's emulated int8
  path: heads after the first come out wrong, while -O0 and -O2 agree with the AVX2 build. So
  before believing a failure here, rebuild that source at another level
  (`EMULATED_OPT_LEVELS`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from radixserve.kernels import cpu, isa
from radixserve.paths import cache_dir

SHIMS = Path(__file__).with_name("emulated_avx512_shims.h")
# the feature macros each emulated tier defines (the compiler's would be __AVX512F__, ...)
TIER_FEATURES: dict[isa.Tier, tuple[str, ...]] = {
    isa.Tier.AVX512: ("AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ"),
    isa.Tier.AVX512_BF16: ("AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ", "AVX512BF16", "AVX512VNNI"),
}
ALL_FEATURES = TIER_FEATURES[isa.Tier.AVX512_BF16]
# -O level per source (see the module docstring); the rest use DEFAULT_OPT_LEVEL
EMULATED_OPT_LEVELS = {"quant_linear": "-O1"}
DEFAULT_OPT_LEVEL = "-O2"


def _rewrite(source: str) -> str:
    """A kernel source (or header) with its AVX-512 guards, intrinsics and types made SIMDe's."""
    for feature in ALL_FEATURES:
        source = source.replace(f"__{feature}__", f"EMULATED_{feature}")
    source = re.sub(r"\b(_mm512_\w+|_mm256_maskz?_\w+)\b", r"simde\1", source)
    source = re.sub(r"\b__m512(\w*)\b", r"simde__m512\1", source)
    source = re.sub(r"\b__mmask(\d+)\b", r"simde__mmask\1", source)
    source = source.replace("_ZGVeN16v_expf", "emu_expf16")
    for masked in ("_mm512_mask_storeu_ps", "_mm256_mask_storeu_epi16", "_mm512_maskz_loadu_ps", "_mm256_maskz_loadu_epi16"):
        source = source.replace(f"simde{masked}", f"emu{masked}")  # SIMDe's touch every lane: the shims
    # a register constraint cannot hold an emulated 64-byte vector: the barrier goes through memory
    return source.replace('#define OPAQUE(v) __asm__("" : "+x"(v))', '#define OPAQUE(v) __asm__ volatile("" : "+m"(v))')


def _simde_include() -> str:
    try:
        import simde_py
    except ImportError as exc:
        raise RuntimeError("--emulate-avx512 needs SIMDe's headers: pip install simde-py==0.8.2.post1 "
                           "(make test-emulated installs it)") from exc
    return simde_py.get_include()


def _key(tier: isa.Tier, include: str) -> str:
    key = hashlib.sha256(str(tier).encode() + include.encode() + SHIMS.read_bytes() + Path(__file__).read_bytes())
    for source in sorted([*cpu.SOURCE_DIR.glob("*.c"), *cpu.SOURCE_DIR.glob("*.h")]):
        key.update(source.name.encode() + source.read_bytes())
    return key.hexdigest()[:16]


def _compile(compiler: str, source: Path, include: str, tier: isa.Tier) -> Path:
    obj = source.with_suffix(".o")
    flags = [EMULATED_OPT_LEVELS.get(source.stem, DEFAULT_OPT_LEVEL), "-ffast-math", "-fopenmp", "-fPIC",
             "-std=gnu11", "-Wno-psabi", *isa.compile_flags(isa.Tier.AVX2), f"-I{include}",
             *(f"-DEMULATED_{feature}" for feature in TIER_FEATURES[tier])]
    subprocess.run([compiler, *flags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True, text=True)
    return obj


def build() -> dict[isa.Tier, Path]:
    """The emulated library of each tier in TIER_FEATURES, built once into the kernel cache (every
    source of every tier compiles in parallel, a compiler per core: minutes)."""
    compiler = cpu._compiler()
    if compiler is None:
        raise RuntimeError("--emulate-avx512 needs a C compiler")
    include = _simde_include()
    targets = {tier: cache_dir() / "kernels" / f"radixserve-emulated-{tier}-{_key(tier, include)}.so"
               for tier in TIER_FEATURES}
    missing = [tier for tier, target in targets.items() if not target.exists()]
    if not missing:
        return targets
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for tier in missing:
            folder = Path(tmp) / str(tier)
            folder.mkdir()
            for source in [*cpu.SOURCE_DIR.glob("*.c"), *cpu.SOURCE_DIR.glob("*.h")]:
                text = _rewrite(source.read_text())
                if source.suffix == ".c":
                    text = f'#include "simde/x86/avx512.h"\n#include "{SHIMS}"\n{text}'
                (folder / source.name).write_text(text)
            jobs += [(tier, source) for source in sorted(folder.glob("*.c"))]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(lambda job: (job[0], _compile(compiler, job[1], include, job[0])), jobs))
        for tier in missing:
            lib = Path(tmp) / f"{tier}.so"
            subprocess.run([compiler, *(str(o) for t, o in objects if t == tier), "-o", str(lib), *cpu.LINK_FLAGS],
                           check=True, capture_output=True, text=True)
            targets[tier].parent.mkdir(parents=True, exist_ok=True)
            os.replace(lib, targets[tier])
    return targets


def install() -> None:
    """`cpu.load_library` gives the emulated builds for the AVX-512 tiers, and the machine's tier
    reads as avx512_bf16, so `cpu_tier` runs those tiers (and the tests that ask for the tier in
    use run the emulated avx512_bf16 build)."""
    libraries = build()
    native = cpu._load_library

    @functools.cache
    def load(tier: isa.Tier) -> ctypes.CDLL | None:
        if tier not in libraries:
            return native(tier)
        lib = ctypes.CDLL(str(libraries[tier]))
        cpu._declare(lib)
        return lib

    cpu._load_library = load
    isa.selected_tier = lambda: isa.Tier.AVX512_BF16
