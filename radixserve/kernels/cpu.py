"""radixserve's CPU kernels (csrc/*.c): built once per machine, called through ctypes.

- `paged_decode`: decode attention that reads K/V pages in place. On the CPU it is bound by
  memory: gathering each request's pages into a padded copy and then running
  `scaled_dot_product_attention` reads the whole context three times and writes it once; the
  kernel reads every K/V row once.
- `prefill_attention`: causal attention of a prefill chunk over its paged context, tiles of
  scores in vector registers (AVX-512, bf16 with the AVX-512 BF16 dot product; or AVX2, bf16
  widened once as K and V are packed), served where it beats torch's CPU flash attention
  (bench/cpu_kernels.py). torch runs its bf16 block matmuls on AMX tiles where the CPU has
  them, so on the AMX tier bf16 stays with torch.
- Both attention kernels read a KV pool of any `--kv-cache-dtype` format
  (`radixserve.kernels.kv_quant`): fp32 or bf16, or fp8 / int8 (with its scales), which they
  dequantize as they read it (decode inside its dot products, prefill while repacking K and V),
  never through a dequantized copy of the context; queries and outputs stay in the model's
  dtype. `supports_kv` and `prefill_attention_serves` say which combinations are served.
- `linear`: fp32 and bf16 linear layers over weights packed once into column panels
  (`pack_linear`; the panel width is the build's); MKL's sgemm repacks nn.Linear's weight on
  every call, which at decode batch sizes costs more than the arithmetic, and oneDNN's bf16
  kernels without AMX stream the weights slower than this kernel does (below AVX-512, torch
  has no fast bf16 matmul at all).
- `quant_linear` (radixserve.kernels.quant_linear): linear layers over GGUF-quantized weights
  (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) kept in their blocks, dequantized inside integer dot products.
- `rms_norm`, `rotary`, `silu_mul`: RMSNorm, rotary embedding and the MLP activation of fp32
  or bf16 rows in one call each (torch needs eight, six and two small ops, which at decode
  batch sizes cost more than their arithmetic).

The sources are plain C with OpenMP (no torch headers), so the system compiler alone builds
them; the first start on a machine waits for the build, later ones load it from the cache. Each
source has a path per ISA tier (`radixserve.kernels.isa`: AVX-512 and AVX-512 BF16 registers,
AVX2 + FMA, or portable C), chosen at compile time by the tier's flags; the library is built
for the tier in use (or any tier the machine supports, for tests and benchmarks) and cached
under $RADIXSERVE_CACHE/kernels/, keyed by the sources, the flags and the compiler. It links
against the libgomp torch already loaded, so the process keeps one OpenMP thread pool.

Without a C compiler, on a build failure, or with RADIXSERVE_DISABLE_CPU_KERNELS=1,
`load_library` returns None (logging why, once) and callers keep their plain-torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from radixserve.kernels import isa
from radixserve.kernels.kv_quant import FORMATS, SCALE_DTYPE, KVFormat
from radixserve.paths import cache_dir

log = logging.getLogger("radixserve.kernels")

SOURCE_DIR = Path(__file__).parent / "csrc"
# -ffast-math lets gcc vectorise the exp and the reductions (glibc's libmvec); it is only on
# the compile step: linking with it would set flush-to-zero for the whole process. The tier's
# ISA flags (isa.compile_flags) come after these.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # compute dtypes (queries, activations)
KV_CODES = frozenset(fmt.code for fmt in FORMATS.values())  # the KV formats the kernels read
DISABLE_ENV = "RADIXSERVE_DISABLE_CPU_KERNELS"


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, target: Path, sources: list[Path] | None = None,
           compile_flags: list[str] = COMPILE_FLAGS) -> None:
    """Compile `sources` (default: all of csrc/) and link them into `target`, atomically
    (concurrent workers may build at once). Compiling and linking are separate steps so that
    -ffast-math never reaches the link (see COMPILE_FLAGS). The sources compile in parallel, a
    compiler per core: at -O3 with the wide tiers' unrolled paths, paged_decode.c and
    quant_linear.c each take far longer than the rest, and a first start waits for the build."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sources = sources or _sources()
        objects = [str(Path(tmp) / (source.stem + ".o")) for source in sources]

        def compile_one(source: Path, obj: str) -> None:
            subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", obj],
                           check=True, capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            # list(): the first failure raises here, with its compiler output
            list(pool.map(compile_one, sources, objects))
        lib = Path(tmp) / target.name
        subprocess.run([compiler, *objects, "-o", str(lib), *LINK_FLAGS],
                       check=True, capture_output=True, text=True)
        os.replace(lib, target)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.paged_decode_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr,
                                           ptr, i64, i64, i64, i64, i64, f32, cint, cint, ptr, ptr, cint]
    lib.paged_decode_attention.restype = cint
    lib.prefill_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64,
                                      i64, i64, f32, cint, cint, cint]
    lib.prefill_attention.restype = cint
    lib.prefill_attention_supported.argtypes = [i64, cint]
    lib.prefill_attention_supported.restype = cint
    lib.prefill_attention_supported_kv.argtypes = [i64, cint, cint]
    lib.prefill_attention_supported_kv.restype = cint
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, cint, cint]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, cint, cint]
    lib.rotary.restype = None
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64, cint, cint]
    lib.silu_mul.restype = None
    lib.linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, cint, cint, cint]
    lib.linear.restype = None
    lib.linear_panel_width.argtypes = []
    lib.linear_panel_width.restype = cint
    lib.linear_serves.argtypes = [cint]
    lib.linear_serves.restype = cint
    lib.quant_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, cint, cint, ptr, ptr, i64, cint, cint, cint]
    lib.quant_linear.restype = cint
    lib.quant_linear_serves.argtypes = [cint]
    lib.quant_linear_serves.restype = cint
    lib.quant_pack.argtypes = [ptr, i64, i64, cint, ptr, cint, cint]
    lib.quant_pack.restype = cint
    lib.quant_dequantize.argtypes = [ptr, i64, i64, cint, cint, ptr, i64, ptr, i64, cint, cint]
    lib.quant_dequantize.restype = cint


def load_library(tier: isa.Tier | None = None) -> ctypes.CDLL | None:
    """The kernel library built for `tier` (default: the tier in use), or None when it cannot
    be built here (logged once)."""
    return _load_library(isa.selected_tier() if tier is None else tier)


@functools.cache
def _load_library(tier: isa.Tier) -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels are off (decode attention uses gather + SDPA)")
        return None
    flags = COMPILE_FLAGS + isa.compile_flags(tier)
    key = hashlib.sha256()
    for source in [*_sources(), *SOURCE_DIR.glob("*.h")]:
        key.update(source.name.encode() + source.read_bytes())
    for part in (" ".join(flags + LINK_FLAGS), compiler):
        key.update(part.encode())
    target = cache_dir() / "kernels" / f"radixserve-cpu-{tier}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target, compile_flags=flags)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
    except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("building the CPU kernels failed, so they are off (decode attention uses "
                    "gather + SDPA): %s", detail.strip()[-2000:])
        return None
    return lib


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels serve tensors of this dtype and device (CPU, fp32 or bf16) here."""
    return device.type == "cpu" and dtype in DTYPE_CODES and load_library() is not None


def fuses(x: torch.Tensor) -> bool:
    """Whether the fused ops (rms_norm, add_rms_norm, rotary, silu_mul) serve x here: fp32 or
    bf16 on the CPU, with the library built."""
    return supports(x.dtype, x.device)


def _dense(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x as a contiguous tensor of `dtype`; x itself when it already is one (checking is much
    cheaper than a no-op `.contiguous()` call, and these run several times per layer)."""
    if (dtype is None or x.dtype == dtype) and x.is_contiguous():
        return x
    return x.to(dtype or x.dtype).contiguous()


def _row_matrix(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as a [rows, width] matrix with unit column stride (its rows may be further apart)."""
    rows = x.reshape(-1, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with its last two dims contiguous (its rows may be further apart: a view of a fused
    projection is fine)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def supports_kv(compute_dtype: torch.dtype, kv_format: KVFormat | str | None, device: torch.device) -> bool:
    """Whether `paged_decode` serves queries of `compute_dtype` (fp32 or bf16) over a KV pool of
    `kv_format` here (None: the pool holds `compute_dtype`). Every format the kernels know
    (`kv_quant.FORMATS`) is served on every tier: the portable loop reads them all, so a caller
    that asks only needs a fallback for other dtypes, other devices or no compiler."""
    fmt = _format(kv_format)
    if fmt is not None and fmt.code not in KV_CODES:
        return False
    return supports(compute_dtype, device)


def _format(kv_format: KVFormat | str | None) -> KVFormat | None:
    """`kv_format` as a KVFormat (a name is looked up in kv_quant.FORMATS)."""
    if kv_format is None or isinstance(kv_format, KVFormat):
        return kv_format
    if kv_format not in FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[kv_format]


def _check_pools(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_format: KVFormat | str | None,
    k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
) -> tuple[KVFormat | None, int, int | None, int | None]:
    """Check q, the pools and the int8 scales against `kv_format`: (the format, its element
    code for the C kernels, and the scales' addresses, None but for int8). The kernels read the
    pools' bytes as the format says, so a mismatch must stop here."""
    if q.dtype not in DTYPE_CODES:
        raise ValueError(f"queries must be float32 or bfloat16, got {q.dtype}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"K and V pools must both be [slots, Hkv, D], got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    fmt = _format(kv_format)
    storage = q.dtype if fmt is None else fmt.storage
    if fmt is not None and fmt.code not in KV_CODES:
        raise ValueError(f"the CPU kernels do not read a {fmt.name} KV pool")
    if k_pool.dtype != storage or v_pool.dtype != storage:
        pool = f"without kv_format the KV pool must be {storage}, as q," if fmt is None else \
            f"a KV pool of {fmt.name} holds {storage},"
        raise ValueError(f"{pool} got {k_pool.dtype} and {v_pool.dtype}")
    if fmt is None or not fmt.scaled:
        if k_scales is not None or v_scales is not None:
            raise ValueError("k_scales and v_scales are for int8 KV pools only")
        return fmt, DTYPE_CODES[q.dtype] if fmt is None else fmt.code, None, None
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is None:
            raise ValueError(f"an int8 KV pool needs k_scales and v_scales ({name} is missing)")
        if scales.dtype != SCALE_DTYPE or scales.shape != k_pool.shape[:2] or not scales.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {SCALE_DTYPE} tensor of shape {tuple(k_pool.shape[:2])}, "
                             f"got {scales.dtype} {tuple(scales.shape)}")
    assert k_scales is not None and v_scales is not None
    return fmt, fmt.code, k_scales.data_ptr(), v_scales.data_ptr()


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    *,
    kv_format: KVFormat | str | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged context.

    q: [B, H, D] fp32 or bf16; k_pool, v_pool: [slots, Hkv, D] (flat slots, contiguous) of
    `kv_format`'s storage dtype (None: q's dtype), read in place and dequantized inside the dot
    products; k_scales, v_scales: [slots, Hkv] fp16, for int8 only; page_table: [B, max_pages]
    int64; seq_lens: [B], the new token included. With k_new, v_new ([B, Hkv, D], the pool's
    dtype) the kernel first stores them at position seq_len - 1 (else they must be in the pool
    already); a quantized pool takes none (the caller stores kv_quant.quantize's bytes and
    scales itself). Returns [B, H, D] in q's dtype. Only call after `supports_kv` said yes.
    """
    lib = load_library()
    assert lib is not None
    fmt, kv_code, k_scales_ptr, v_scales_ptr = _check_pools(q, k_pool, v_pool, kv_format, k_scales, v_scales)
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape[2] != head_dim:
        raise ValueError(f"q heads {heads} x {head_dim} do not fit pool heads {tuple(k_pool.shape[1:])}")
    q = _rows(q)
    page_table, seq_lens = _dense(page_table, torch.int64), _dense(seq_lens, torch.int64)
    if (k_new is not None or v_new is not None) and fmt is not None and fmt.quantized:
        raise ValueError(f"a {fmt.name} KV pool takes no k_new/v_new: store kv_quant.quantize's bytes and scales first")
    if k_new is not None and v_new is not None:
        k_new, v_new = _rows(k_new), _rows(v_new)
        if k_new.shape != (batch, kv_heads, head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"new K/V must be [{batch}, {kv_heads}, {head_dim}]")
        if k_new.dtype != k_pool.dtype or v_new.dtype != k_pool.dtype:
            raise ValueError(f"new K/V must be {k_pool.dtype}, as the pool, got {k_new.dtype} and {v_new.dtype}")
        new_k_ptr, new_k_stride = k_new.data_ptr(), k_new.stride(0)
        new_v_ptr, new_v_stride = v_new.data_ptr(), v_new.stride(0)
    elif k_new is None and v_new is None:
        new_k_ptr = new_v_ptr = None
        new_k_stride = new_v_stride = 0
    else:
        raise ValueError("pass both k_new and v_new, or neither")
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype)
    failed = lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), new_k_ptr, new_k_stride, new_v_ptr, new_v_stride,
        k_pool.data_ptr(), v_pool.data_ptr(), page_table.data_ptr(), page_table.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, head_dim, page_size, scale,
        DTYPE_CODES[q.dtype], kv_code, k_scales_ptr, v_scales_ptr, torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
    return out


def torch_owns_bf16_matmuls() -> bool:
    """On the AMX tier torch runs bf16 matmuls and attention blocks on AMX tiles, and there
    radixserve's bf16 kernels for those step aside."""
    return isa.at_least(isa.Tier.AMX)


def prefill_attention_serves(dtype: torch.dtype, head_dim: int, device: torch.device,
                             kv_format: KVFormat | str | None = None) -> bool:
    """Whether `prefill_attention` serves this compute dtype and head size over a KV pool of
    `kv_format` (None: of `dtype`) here: where the tier's build beats torch's flash attention
    (`prefill_attention_supported` in csrc/prefill_attention.c says which head sizes and
    dtypes, per tier; a pool of another format is repacked into fp32 words and served where
    that tile is), and never bf16 on the AMX tier, whatever the pool."""
    if not supports(dtype, device) or (dtype == torch.bfloat16 and torch_owns_bf16_matmuls()):
        return False
    lib = load_library()
    fmt = _format(kv_format)
    if fmt is None:
        return bool(lib.prefill_attention_supported(head_dim, DTYPE_CODES[dtype]))
    if fmt.code not in KV_CODES:
        return False
    return bool(lib.prefill_attention_supported_kv(head_dim, DTYPE_CODES[dtype], fmt.code))


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    prefix_len: int,
    scale: float,
    out: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    kv_format: KVFormat | str | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Causal attention of E new tokens over their request's paged context, into `out`.

    q: [E, H, D] fp32 or bf16 (rows may be strided); k_pool, v_pool: [slots, Hkv, D],
    contiguous, of `kv_format`'s storage dtype (None: q's dtype; k_scales, v_scales [slots, Hkv]
    fp16 for int8), already holding every position the new tokens see; pages: the request's
    page ids in order (int64); out: [E, H, D] contiguous, q's dtype. New token i sits at
    position prefix_len + i, or, with `positions` ([E] ascending, on the CPU), at positions[i]
    (scattered queries, as a selective recompute has them: the positions between are stored
    already); it sees positions 0 .. its own. Only call after `prefill_attention_serves` said
    yes.
    """
    lib = load_library()
    assert lib is not None
    fmt, kv_code, k_scales_ptr, v_scales_ptr = _check_pools(q, k_pool, v_pool, kv_format, k_scales, v_scales)
    if out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype}, as q, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("the KV pool and the output must be contiguous")
    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit pool heads {tuple(k_pool.shape[1:])} or out {tuple(out.shape)}")
    pages = _dense(pages, torch.int64)
    seq_len = prefix_len + tokens
    if positions is not None:
        positions = _dense(positions, torch.int64)
        if positions.shape != (tokens,):
            raise ValueError(f"positions must be [{tokens}], got {tuple(positions.shape)}")
        if tokens and (int(positions[0]) < 0 or (tokens > 1 and bool((positions[1:] <= positions[:-1]).any()))):
            raise ValueError("positions must be ascending and not negative")
        seq_len = int(positions[-1]) + 1 if tokens else 0
    if pages.numel() * page_size < seq_len:
        raise ValueError(f"{pages.numel()} pages of {page_size} cannot hold {seq_len} positions")
    q = _rows(q)
    failed = lib.prefill_attention(
        q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), k_scales_ptr, v_scales_ptr,
        pages.data_ptr(), page_size, prefix_len, tokens, None if positions is None else positions.data_ptr(),
        out.data_ptr(), heads, kv_heads, head_dim, scale, DTYPE_CODES[q.dtype], kv_code, torch.get_num_threads(),
    )
    if failed == 1:
        raise MemoryError("the CPU prefill kernel could not allocate its scratch memory")
    if failed:
        pool = "" if fmt is None else f" over a KV pool of {fmt.name}"
        raise ValueError(f"the CPU prefill kernel does not serve {str(q.dtype).removeprefix('torch.')} "
                         f"with head size {head_dim}{pool}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of rows (last dim): `weight * (x * rsqrt(mean(x^2) + eps))` in
    fp32, rounded to x's dtype before the weight. Only call after `fuses(x)`."""
    return _rms_norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) for [T, dim] tensors, in one pass."""
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = load_library()
    assert lib is not None and x.dtype == weight.dtype
    dim = x.shape[-1]
    rows = _row_matrix(x, dim)
    weight = _dense(weight)
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype)
    total = None
    if residual is not None:
        residual = _dense(residual.reshape(rows.shape))
        total = torch.empty_like(out)
    lib.rms_norm(rows.data_ptr(), rows.stride(0), None if residual is None else residual.data_ptr(),
                 None if total is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                 rows.shape[0], dim, eps, DTYPE_CODES[x.dtype], torch.get_num_threads())
    return (None if total is None else total.view(x.shape)), out.view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half rotary (bit-identical for bf16, to the last bit for fp32):
    x [T, heads, D] (a view of a fused projection is fine), cos/sin [T, D]. Only call after
    `fuses(x)`."""
    lib = load_library()
    assert lib is not None and x.dtype == cos.dtype == sin.dtype
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    cos, sin = _dense(cos), _dense(sin)
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    lib.rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
               tokens, heads, dim, DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [T, 2I] tensor (gate first) -> [T, I]. Only call after
    `fuses(gate_up)`."""
    lib = load_library()
    assert lib is not None and gate_up.dim() == 2
    gate_up = _dense(gate_up)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), tokens, inter, DTYPE_CODES[gate_up.dtype],
                 torch.get_num_threads())
    return out


def linear_builds(dtype: torch.dtype, in_features: int) -> bool:
    """Whether the tier's build of `linear` has a tile for weights of this dtype and input
    size: fp32 always, bf16 from the avx2 tier up with an even input size (it reads pairs)."""
    if not supports(dtype, torch.device("cpu")):
        return False
    if dtype == torch.bfloat16 and in_features % 2:
        return False
    return bool(load_library().linear_serves(DTYPE_CODES[dtype]))


def linear_serves(dtype: torch.dtype, in_features: int) -> bool:
    """Whether `linear` is the linear layers' kernel here: where it builds, but for bf16 on the
    AMX tier, where torch's AMX matmuls are faster."""
    return linear_builds(dtype, in_features) and not (dtype == torch.bfloat16 and torch_owns_bf16_matmuls())


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's weight [N, K] -> the panels `linear` reads, as 32-bit words, P = the panel
    width, zero past N: fp32 [ceil(N / P), K, P]; bf16 [ceil(N / P), K / 2, P] int32, each word
    the pair W[n, 2k], W[n, 2k + 1]. Only call after `linear_builds` said yes."""
    lib = load_library()
    assert lib is not None and weight.dim() == 2
    width = lib.linear_panel_width()
    padding = -weight.shape[0] % width
    padded = torch.nn.functional.pad(weight, (0, 0, 0, padding)) if padding else weight
    if weight.dtype == torch.bfloat16:
        pairs = padded.contiguous().view(torch.int32)  # [N, K / 2]: the pairs, in memory order
        return pairs.reshape(-1, width, weight.shape[1] // 2).transpose(1, 2).contiguous()
    return padded.reshape(-1, width, weight.shape[1]).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, in_features: int,
           out_features: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias, W given as `pack_linear(W)`, in x's dtype or in `out_dtype`
    float32: the fp32 sums of bf16 inputs, not rounded to bf16."""
    lib = load_library()
    out_dtype = out_dtype or x.dtype
    assert lib is not None and x.dtype in DTYPE_CODES and out_dtype in (x.dtype, torch.float32)
    rows = _row_matrix(x, in_features)
    if bias is not None:
        bias = _dense(bias)
    out = torch.empty((rows.shape[0], out_features), dtype=out_dtype)
    lib.linear(rows.data_ptr(), rows.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
               out.data_ptr(), rows.shape[0], in_features, out_features, DTYPE_CODES[x.dtype],
               DTYPE_CODES[out_dtype], torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)
