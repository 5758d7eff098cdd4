"""Paged attention on CUDA with FlashInfer (written against flashinfer-python 0.2.14.post1).

One forward = one `plan` + one `run` per layer:

- steps with a prefill chunk: `BatchPrefillWithPagedKVCacheWrapper`, causal, ragged queries
  over paged KV (FlashInfer aligns the causal mask to the end of each request's KV, so new
  token i of a request with a cached prefix of P tokens sees positions 0 .. P + i); with
  scattered queries (`AttentionBatch.query_positions`, a selective recompute) that alignment
  is wrong, and the plan takes a custom mask instead (`paged_indices.causal_mask`: each new
  token sees the keys up to its own position). A decode step needs none: each row's KV ends at
  its own position;
- pure decode steps: `BatchDecodeWithPagedKVCacheWrapper`, with tensor cores when the GQA
  group is 4 or more (its kernel is then the prefill module's, so one JIT build serves both);
- decode steps replayed from CUDA graphs: one decode wrapper per graph batch size in
  FlashInfer's graph mode, reading indices from fixed buffers that `plan_graph_decode` fills.

Every wrapper shares one float workspace buffer. The index arrays come from
`paged_indices.build_paged_indices` (CPU-tested): indptrs on the host, page ids gathered from
the worker's page table on the GPU. New K/V go into their pages by an indexed copy on the flat
slots (`index_copy_`), which CUDA graphs capture as one kernel per layer and K/V.

API notes: `plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
num_kv_heads, head_dim, page_size, ...)` is called positionally (0.2.x named the head size
`head_dim_qk` in the prefill wrapper and `head_dim` in the decode wrapper), then
`run(q, (k_cache, v_cache))` with NHD caches. 0.3.1 has the same signatures.
"""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.paged_indices import build_paged_indices, causal_mask

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer recommends 128 MB; split-k at batch 256 wants more
PREFILL_KERNELS = "fa2"  # fa3 (Hopper) is a second JIT build; try it once fa2 is measured
TENSOR_CORE_DECODE_MIN_GROUP = 4  # num_heads / num_kv_heads from which tensor cores win (SGLang's rule)


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged prefill/decode over the NHD pool; capturable in CUDA graphs for decode."""

    supports_cuda_graph = True

    def __init__(
        self,
        pool: KVPool,
        shape: AttentionShape,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_kernels: str = PREFILL_KERNELS,
        decode_tensor_cores: bool | None = None,
    ) -> None:
        super().__init__(pool, shape)
        import flashinfer  # only here: CPU workers never import it

        self._fi = flashinfer
        device = pool.device
        if decode_tensor_cores is None:
            decode_tensor_cores = shape.num_heads // shape.num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP
        self._tensor_cores = decode_tensor_cores
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_kernels
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=decode_tensor_cores
        )
        self._graph_decode: dict[int, object] = {}  # batch size -> wrapper in graph mode
        self._active: object | None = None  # the wrapper the last plan prepared
        self._out_slots: torch.Tensor | None = None  # [T] flat slots of the planned tokens

    # ------------------------------------------------------------------ eager steps

    def plan(self, batch: AttentionBatch) -> None:
        idx = build_paged_indices(batch, self.pool.device)
        self._out_slots = idx.out_slots
        if batch.is_decode:
            self._plan_decode(self._decode, idx, batch.page_size)
        else:
            s = self.shape
            qo_indptr, kv_indptr, last_page_len = idx.qo_indptr, idx.kv_indptr, idx.kv_last_page_len
            mask = None
            if batch.scattered:
                # FlashInfer packs a custom mask into bits on the GPU, per request at offsets it
                # derives from these three arrays, so they go there too (its segment_packbits
                # refuses host ones; a mask packed here would be read at unpacked offsets)
                device = self.pool.device
                mask = causal_mask(batch).to(device)
                qo_indptr, kv_indptr, last_page_len = (t.to(device) for t in (qo_indptr, kv_indptr, last_page_len))
            self._prefill.plan(
                qo_indptr, kv_indptr, idx.kv_indices, last_page_len,
                s.num_heads, s.num_kv_heads, s.head_dim, batch.page_size,
                custom_mask=mask, causal=mask is None, sm_scale=s.scale,
                q_data_type=self.pool.dtype, kv_data_type=self.pool.format.storage,
            )
            self._active = self._prefill

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D] -> [T, H, D]."""
        self.pool.store(layer_id, self._out_slots, k, v)  # fp8 pools: quantized once, here
        cache = (self.pool.k[layer_id], self.pool.v[layer_id])  # [P + 1, page_size, Hkv, D] each
        return self._active.run(q.contiguous(), cache)

    # ------------------------------------------------------------------ CUDA graphs

    def init_graph_decode(self, batch_sizes: list[int], max_pages_per_request: int) -> None:
        """One graph-mode decode wrapper per batch size, over views of shared fixed buffers."""
        device = self.pool.device
        max_bs = max(batch_sizes)
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max_bs * max_pages_per_request, dtype=torch.int32, device=device)
        self._g_last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self._g_slots = torch.zeros(max_bs, dtype=torch.int64, device=device)
        for bs in batch_sizes:
            self._graph_decode[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last_page_len[:bs],
            )

    def plan_graph_decode(self, batch: AttentionBatch) -> None:
        bs = batch.batch_size
        if bs not in self._graph_decode or not batch.is_decode:
            raise ValueError(f"no decode graph for a batch of {bs} (sizes {sorted(self._graph_decode)})")
        idx = build_paged_indices(batch, self.pool.device)
        self._g_slots[:bs].copy_(idx.out_slots)
        self._out_slots = self._g_slots[:bs]  # the captured kernels read this buffer
        self._plan_decode(self._graph_decode[bs], idx, batch.page_size)

    def _plan_decode(self, wrapper, idx, page_size: int) -> None:
        s = self.shape
        wrapper.plan(
            idx.kv_indptr, idx.kv_indices, idx.kv_last_page_len,
            s.num_heads, s.num_kv_heads, s.head_dim, page_size,
            sm_scale=s.scale, q_data_type=self.pool.dtype, kv_data_type=self.pool.format.storage,
        )
        self._active = wrapper
