"""A stand-in for the `flashinfer` package on the CPU: the two paged wrappers, in plain torch.

It implements what FlashInfer 0.2.14's docstrings specify, and refuses what the real one
refuses (int32 indptrs, NHD caches, fixed batch size and buffers in CUDA-graph mode, q/kv dtypes
matching the plan), so the CPU tests exercise `FlashInferBackend`'s calls, index arrays and
graph plumbing. Its numbers say nothing about FlashInfer's kernels: tests/unit/test_gpu.py does.

Semantics it follows (prefill/append over paged KV, NHD layout):
- request i's queries are q[qo_indptr[i]:qo_indptr[i+1]];
- its keys/values are pages kv_indices[kv_indptr[i]:kv_indptr[i+1]], all full but the last,
  which holds kv_last_page_len[i] tokens;
- causal masks align to the end of the KV: query j of n sees keys 0 .. kv_len - n + j;
- a prefill plan's `custom_mask` (flattened bool, per request row-major [n, kv_len]) replaces
  the causal mask;
- query head h reads KV head h // (num_qo_heads // num_kv_heads).
In CUDA-graph mode `plan` copies indices into the caller's buffers and `run` reads only those.
"""

from __future__ import annotations

import math

import torch

__version__ = "0.0.0-fake"


class _Paged:
    """What both wrappers share: plan bookkeeping and the naive paged attention."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, use_cuda_graph: bool) -> None:
        if kv_layout != "NHD":
            raise ValueError(f"fake flashinfer supports NHD only, got {kv_layout}")
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            raise ValueError("float_workspace_buffer must be a uint8 tensor")
        self.use_cuda_graph = use_cuda_graph
        self.plan_calls = 0
        self.run_calls = 0
        self.custom_mask: torch.Tensor | None = None

    def _store(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
               head_dim, page_size, causal, sm_scale, q_data_type, kv_data_type) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_len", last_page_len)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if bool(((last_page_len < 1) | (last_page_len > page_size)).any()):
            raise ValueError("kv_last_page_len must be in 1..page_size")
        batch = len(kv_indptr) - 1
        if len(qo_indptr) != batch + 1 or len(last_page_len) != batch:
            raise ValueError("indptr/last_page_len lengths disagree")
        if self.use_cuda_graph:
            if batch != self.fixed_batch_size:
                raise ValueError(f"batch size {batch} != fixed {self.fixed_batch_size} in graph mode")
            if len(kv_indices) > len(self.indices_buf):
                raise ValueError("kv_indices exceed the indices buffer")
            self.indptr_buf.copy_(kv_indptr)
            self.last_buf.copy_(last_page_len)
            self.indices_buf[: len(kv_indices)].copy_(kv_indices)
        else:
            self.indptr_buf, self.indices_buf, self.last_buf = kv_indptr, kv_indices, last_page_len
        self.qo_indptr = qo_indptr.cpu()
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size, self.causal = page_size, causal
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.q_dtype = q_data_type
        self.kv_dtype = kv_data_type or q_data_type
        self.plan_calls += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        h, hkv, d = self.heads
        if q.dtype != self.q_dtype or k_cache.dtype != self.kv_dtype:
            raise ValueError(f"q/kv dtypes {q.dtype}/{k_cache.dtype} differ from the plan's")
        if q.dim() != 3 or q.shape[1:] != (h, d) or k_cache.shape[1:] != (self.page_size, hkv, d):
            raise ValueError(f"bad shapes q {tuple(q.shape)} k_cache {tuple(k_cache.shape)}")
        if not q.is_contiguous():
            raise ValueError("q must be contiguous")
        self.run_calls += 1
        indptr, indices, last = self.indptr_buf.cpu(), self.indices_buf.cpu(), self.last_buf.cpu()
        qo = self.qo_indptr
        out = torch.empty_like(q)
        mask_at = 0
        for i in range(len(indptr) - 1):
            pages = indices[indptr[i] : indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * self.page_size + int(last[i])
            k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float()  # [L, Hkv, D]
            v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float()
            qi = q[qo[i] : qo[i + 1]].float()  # [n, H, D]
            n = qi.shape[0]
            k = k.repeat_interleave(h // hkv, dim=1)  # [L, H, D]
            v = v.repeat_interleave(h // hkv, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", qi, k) * self.sm_scale
            if self.custom_mask is not None:
                allowed = self.custom_mask[mask_at : mask_at + n * kv_len].cpu().view(n, kv_len)
                mask_at += n * kv_len
                scores = scores.masked_fill(~allowed[None], float("-inf"))
            elif self.causal:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
                scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[qo[i] : qo[i + 1]] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        if use_cuda_graph:
            raise NotImplementedError("the fake prefill wrapper has no CUDA-graph mode")
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, **unused) -> None:
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                    num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                    _dtype(q_data_type), _dtype(kv_data_type))
        if custom_mask is not None:
            if custom_mask.dtype != torch.bool:
                raise ValueError("custom_mask must be bool")
            qo_lens = qo_indptr[1:] - qo_indptr[:-1]
            pages = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
            kv_lens = (pages - 1) * page_size + paged_kv_last_page_len
            if custom_mask.numel() != int((qo_lens.long() * kv_lens.long()).sum()):
                raise ValueError("custom_mask must hold sum(q_len[i] * k_len[i]) elements")
        self.custom_mask = custom_mask


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not isinstance(buf, torch.Tensor):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self.fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            self.indptr_buf = paged_kv_indptr_buffer
            self.indices_buf = paged_kv_indices_buffer
            self.last_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True, **unused) -> None:
        batch = len(last_page_len)
        qo = torch.arange(batch + 1, dtype=torch.int32)
        self._store(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                    page_size, False, sm_scale, _dtype(q_data_type), _dtype(kv_data_type))


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    return getattr(torch, value)
