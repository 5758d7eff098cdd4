"""Paged attention in plain PyTorch: the CPU backend and the reference for the CUDA one.

Decode requests (one new token each) are attended in one call: on the CPU by the C kernel
`radixserve.kernels.cpu.paged_decode`, which reads the pages in place; elsewhere, or without a
C compiler, by one batched SDPA over their gathered, padded contexts; on the CPU kernel so is
each token of a request with very few new tokens (`SHORT_EXTEND`). Requests with more new
tokens (prefill chunks) are attended one by one: on the CPU, where it is faster, by the C kernel
`prefill_attention` (pages read in place; see `cpu_kernels.prefill_attention_serves`), else by
SDPA with a causal mask offset by the cached prefix, where a request with no cached prefix
attends straight over its new keys and values without touching the pool. New tokens at
scattered positions (`AttentionBatch.query_positions`) take every path: a decode row's context
ends at its own position, the prefill kernel takes the positions, SDPA a mask built from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend, AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels import cpu as cpu_kernels

# On the CPU kernels an extend of at most this many tokens is attended as that many decode rows,
# each reading its context in place. A checked draft (up to --speculative-num-draft-tokens + 1
# tokens over a long context) is one: its rows are then attended exactly as plain decoding
# attends them one step at a time, so with the panel linears (the same sums whatever rows are
# computed together) speculation gives plain decoding's tokens in bf16 too. The prefill kernel
# repacks the whole context per call, which a few decode rows' reads undercut; past a dozen or
# so rows it is the cheaper one (`python -m bench.kernel_revisions` times checked drafts).
SHORT_EXTEND = 16


class TorchNativeBackend(AttentionBackend):
    """Exact paged attention: SDPA or the CPU prefill kernel for prefill chunks, the CPU decode
    kernel or SDPA for decode.

    `use_cpu_kernel=False` keeps attention on SDPA even where the kernels are available (the
    tests run both paths against each other)."""

    def __init__(self, pool: KVPool, shape: AttentionShape, use_cpu_kernel: bool = True) -> None:
        super().__init__(pool, shape)
        # a pool of another dtype than the model's (--kv-cache-dtype: 8 bits) is read in place
        # by the kernels, or dequantized by `KVPool.read` on the SDPA paths
        self._kv_format = pool.format if pool.converted else None
        if self._kv_format is None:
            served = cpu_kernels.supports(pool.dtype, pool.device)
        else:
            served = cpu_kernels.supports_kv(pool.dtype, self._kv_format, pool.device)
        self.uses_cpu_kernel = use_cpu_kernel and served
        self.uses_prefill_kernel = use_cpu_kernel and cpu_kernels.prefill_attention_serves(
            pool.dtype, shape.head_dim, pool.device, kv_format=self._kv_format
        )
        # Decode gathers reuse two buffers: fresh multi-MB tensors every layer cost page faults
        # (malloc hands large blocks back to the OS), about half the gather time on CPU.
        self._gather_k = torch.empty(0, device=pool.device, dtype=pool.dtype)
        self._gather_v = torch.empty(0, device=pool.device, dtype=pool.dtype)

    def plan(self, batch: AttentionBatch) -> None:
        device = self.pool.device
        ps = batch.page_size
        seq_lens = batch.seq_lens
        page_table = batch.page_table.to(device)
        self._all_decode = batch.is_decode
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        # a request with one new token is a decode row; on the CPU kernels so is each token of a
        # short extend (a draft being checked), its context up to and with it
        short = SHORT_EXTEND if self.uses_cpu_kernel else 1
        decode_of: list[int] = []  # the request of each decode row
        decode_lens: list[int] = []
        decode_rows: list[int] = []  # its token's row in the packed q
        extend_of: list[int] = []  # the requests attended as prefill chunks
        for i, extend in enumerate(batch.extend_lens):
            if extend <= short:
                decode_of += [i] * extend
                decode_lens += (p + 1 for p in batch.positions(i))
                decode_rows += range(starts[i], starts[i + 1])
            else:
                extend_of.append(i)
        if decode_of and self.uses_cpu_kernel:  # the kernel finds every slot itself
            self._decode_pages = page_table[decode_of].contiguous()
            self._decode_lens = torch.tensor(decode_lens, device=device)
        # every new token a decode row (a decode step, checks only): the kernel also stores every
        # row's key and value itself, so no per-layer scatter into the pool or gather of rows;
        # quantized ones are stored here first (`KVPool.store`), at their rows' slots
        self._rows_only = self.uses_cpu_kernel and not extend_of
        if self._rows_only:
            if self._kv_format is not None:
                last = self._decode_lens - 1
                self._row_slots = self._decode_pages.gather(1, (last // ps)[:, None])[:, 0] * ps + last % ps
            return
        max_len = max(seq_lens)
        # slots[i, pos] = flat slot of position pos of request i (garbage past seq_len i)
        pos = torch.arange(max_len, device=device)
        page_idx = (pos // ps).clamp(max=page_table.shape[1] - 1)
        slots = page_table[:, page_idx] * ps + pos % ps  # [B, max_len]
        # each request's new positions: a range, or scattered (then also as a tensor)
        scattered: list[torch.Tensor | None] = [None] * batch.batch_size
        if batch.scattered:
            scattered = [None if p is None else torch.tensor(p, device=device) for p in batch.query_positions]
        self._out_slots = torch.cat(
            [slots[i, p:s] if scattered[i] is None else slots[i, scattered[i]]
             for i, (p, s) in enumerate(zip(batch.prefix_lens, seq_lens))]
        )  # [T]: `forward` stores every new key and value before it attends
        self._extends = [
            _Extend(starts[i], starts[i + 1], batch.prefix_lens[i], slots[i, : seq_lens[i]],
                    page_table[i, : -(-seq_lens[i] // ps)], scattered[i])
            for i in extend_of
        ]
        self._decode_rows = torch.tensor(decode_rows, device=device) if decode_of else None
        if not decode_of or self.uses_cpu_kernel:
            return
        lens = torch.tensor(decode_lens, device=device)
        dec_len = int(lens.max())
        self._decode_slots = slots[decode_of, :dec_len]  # [Bd, L]
        # [Bd, 1, 1, L]: True where the key position is part of the request's context
        self._decode_mask = (pos[:dec_len][None, :] < lens[:, None])[:, None, None, :]
        rows = len(decode_of) * dec_len
        if self._gather_k.shape[0] < rows:
            shape = (rows, self.shape.num_kv_heads, self.shape.head_dim)
            self._gather_k = torch.empty(shape, device=device, dtype=self.pool.dtype)
            self._gather_v = torch.empty(shape, device=device, dtype=self.pool.dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        k_pool = self.pool.flat_k(layer_id)
        v_pool = self.pool.flat_v(layer_id)
        self._layer = layer_id
        if self._rows_only:
            if self._kv_format is None:  # the kernel stores k, v itself
                return self._kernel_decode(q, k_pool, v_pool, k, v)
            self.pool.store(layer_id, self._row_slots, k, v)
            return self._kernel_decode(q, k_pool, v_pool)
        self.pool.store(layer_id, self._out_slots, k, v)
        scale = self.shape.scale
        if self._all_decode:
            return self._decode(q, k_pool, v_pool)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_scales, v_scales = self.pool.flat_scales(layer_id)
        for ext in self._extends:
            if self.uses_prefill_kernel:
                cpu_kernels.prefill_attention(
                    q[ext.start : ext.end], k_pool, v_pool, ext.pages, self.pool.page_size,
                    ext.prefix_len, scale, out[ext.start : ext.end], positions=ext.positions,
                    kv_format=self._kv_format, k_scales=k_scales, v_scales=v_scales,
                )
                continue
            qi = q[ext.start : ext.end].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
            if ext.prefix_len == 0 and ext.positions is None and self._kv_format is None:
                ki, vi = k[ext.start : ext.end], v[ext.start : ext.end]  # [E, Hkv, D]
                mask, causal = None, True
            else:  # what the pool holds (a quantized pool's values, as every other path reads them)
                ki, vi = self.pool.read(layer_id, ext.slots, q.dtype)  # [S, Hkv, D]
                mask, causal = _causal_mask(ext, q.device), False
            oi = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
            )  # [1, H, E, D]
            out[ext.start : ext.end] = oi[0].transpose(0, 1)
        if self._decode_rows is not None:
            out[self._decode_rows] = self._decode(q[self._decode_rows], k_pool, v_pool)
        return out

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """One new token per request: q [Bd, H, D] over each request's context."""
        if self.uses_cpu_kernel:
            return self._kernel_decode(q, k_pool, v_pool)
        # index_select on flat slots is ~4x faster on CPU than advanced indexing with a 2-D index
        shape = (*self._decode_slots.shape, *k_pool.shape[1:])  # [Bd, L, Hkv, D]
        flat = self._decode_slots.flatten()
        rows = flat.shape[0]
        if self._kv_format is not None:
            kd, vd = (t.view(shape).transpose(1, 2) for t in self.pool.read(self._layer, flat, q.dtype))
        else:
            kd = torch.index_select(k_pool, 0, flat, out=self._gather_k[:rows]).view(shape).transpose(1, 2)
            vd = torch.index_select(v_pool, 0, flat, out=self._gather_v[:rows]).view(shape).transpose(1, 2)
        # kd, vd: [Bd, Hkv, L, D]
        od = F.scaled_dot_product_attention(
            q.unsqueeze(2), kd, vd, attn_mask=self._decode_mask, scale=self.shape.scale, enable_gqa=True
        )  # [Bd, H, 1, D]
        return od.squeeze(2)

    def _kernel_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
        k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The planned decode rows through the CPU kernel; with k_new, v_new it stores them first."""
        k_scales, v_scales = self.pool.flat_scales(self._layer)
        return cpu_kernels.paged_decode(
            q, k_pool, v_pool, self._decode_pages, self._decode_lens, self.pool.page_size,
            self.shape.scale, k_new=k_new, v_new=v_new,
            kv_format=self._kv_format, k_scales=k_scales, v_scales=v_scales,
        )


class _Extend:
    """A request with several new tokens: its rows in the packed q, its context's slots and
    its pages; `positions` [E] where its new tokens are scattered, else None (prefix_len ..)."""

    __slots__ = ("start", "end", "prefix_len", "slots", "pages", "positions")

    def __init__(self, start: int, end: int, prefix_len: int, slots: torch.Tensor, pages: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        self.start, self.end, self.prefix_len, self.slots, self.pages = start, end, prefix_len, slots, pages
        self.positions = positions


def _causal_mask(ext: _Extend, device: torch.device) -> torch.Tensor:
    """[E, S] bool: each new token sees the context up to its own position (new token i sits
    at prefix_len + i, or at its scattered position)."""
    if ext.positions is None:
        rows = torch.arange(ext.end - ext.start, device=device)[:, None] + ext.prefix_len
    else:
        rows = ext.positions[:, None]
    cols = torch.arange(ext.slots.shape[0], device=device)[None, :]
    return cols <= rows
