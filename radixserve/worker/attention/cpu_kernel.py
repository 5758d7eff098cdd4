"""The CPU paged-decode kernel (csrc/paged_decode.c): built once per machine, called via ctypes.

Decode attention on the CPU is memory-bound: gathering each request's pages into a padded copy
and then running `scaled_dot_product_attention` reads the whole context three times and writes
it once. The kernel reads every K/V row once, in place. It is plain C with OpenMP (no torch
headers), so building it takes about a second with the system compiler; the shared library is
cached under $RADIXSERVE_CACHE/kernels/, keyed by the source, the flags, the compiler and the
CPU's feature flags (it is built with -march=native). It links against the libgomp that torch
already loaded, so the process keeps one OpenMP thread pool.

Without a C compiler, or on a build failure, `load_paged_decode` returns None once (logging why)
and torch_native keeps its gather + SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from radixserve.models.resolve import cache_dir

log = logging.getLogger("radixserve.worker")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -ffast-math lets gcc vectorise the exp and the reductions (glibc's libmvec); it is only on
# the compile step: linking with it would set flush-to-zero for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, target: Path) -> None:
    """Compile and link into `target`, atomically (concurrent workers may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / target.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        subprocess.run([compiler, str(obj), "-o", str(lib), *LINK_FLAGS],
                       check=True, capture_output=True, text=True)
        os.replace(lib, target)


@functools.cache
def load_paged_decode() -> ctypes.CDLL | None:
    """The built kernel library, or None when it cannot be built here (logged once)."""
    if os.environ.get("RADIXSERVE_DISABLE_CPU_KERNEL") == "1":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the slower gather + SDPA path")
        return None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                 compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    target = cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("building the CPU decode kernel failed, using gather + SDPA: %s", detail.strip()[-2000:])
        return None
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64,
                   i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel serves this pool (CPU, fp32 or bf16) and could be built."""
    return device.type == "cpu" and dtype in DTYPE_CODES and load_paged_decode() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with its last two dims contiguous (its rows may be further apart: a view of a fused
    projection is fine)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


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
) -> torch.Tensor:
    """Attention of one new token per request over its paged context.

    q: [B, H, D]; k_pool, v_pool: [slots, Hkv, D] (flat slots, contiguous); page_table:
    [B, max_pages] int64; seq_lens: [B], the new token included. With k_new, v_new
    ([B, Hkv, D]) the kernel first stores them at position seq_len - 1 (else they must be in
    the pool already). Returns [B, H, D] in q's dtype. Only call after `supports` said yes.
    """
    lib = load_paged_decode()
    assert lib is not None and q.dtype == k_pool.dtype == v_pool.dtype
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape[2] != head_dim:
        raise ValueError(f"q heads {heads} x {head_dim} do not fit pool heads {tuple(k_pool.shape[1:])}")
    q = _rows(q)
    page_table = page_table.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if k_new is not None and v_new is not None:
        k_new, v_new = _rows(k_new), _rows(v_new)
        if k_new.shape != (batch, kv_heads, head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"new K/V must be [{batch}, {kv_heads}, {head_dim}]")
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
        DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
    return out
