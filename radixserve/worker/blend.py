"""Segment blending on the worker (CacheBlend): a chunk whose runs of tokens take their KV from
cached segments, and the selective forward that repairs the most wrong of those copies.

A segment's KV is computed once standalone, at positions 0 .. L - 1, and cached. Reused at
another position of another request (`protocol.SegmentReuse`), its K/V are copied into the
request's pages for every layer, keys re-rotated by the offset (`copy_segment_kv`). The copies
ignore everything before the segment in the request, so they are wrong, and the more so the
deeper the layer. The selective forward (`blend_forward`), over every chunk of a step at once
(a chunk without runs is a plain one, all its tokens kept):

1. layers 0 .. FULL_LAYERS - 2 run over every token of the chunks, as a plain forward would,
   and so does the q/k/v projection of layer FULL_LAYERS - 1 (the *probe* layer): every token's
   fresh K/V are stored there;
2. in each run, the `recompute` tokens whose fresh K/V at the probe layer differ most from
   their copies (squared L2 of the K difference plus the V difference, over heads; ties to the
   earlier position) are picked;
3. the probe layer's attention and MLP, and layers FULL_LAYERS .. L - 1, run over the fresh
   tokens (those in no run; a prompt's last token always among them) and the picked ones only,
   at their scattered positions (`AttentionBatch.query_positions`), attending causally over the
   blended context; the other reused tokens keep their copies in the later layers. (Their
   hidden states past the probe layer's K/V would feed nothing: the selective forward leaves
   them uncomputed, and what it computes is what running the probe layer whole would give.)

Every choice is made per run from values that depend only on the request's tokens before and
in the run, so a request chunked differently (a crash-resumed one), with chunk boundaries
between runs, blends to the same KV and logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch
from radixserve.attention.kv_pool import KVPool, raw
from radixserve.kernels.kv_quant import dequantize, quantize
from radixserve.models.layers import RotaryEmbedding, apply_rotary
from radixserve.models.llama import LlamaForCausalLM
from radixserve.protocol import SegmentReuse

FULL_LAYERS = 2
"""Every token of a blended chunk runs through layers 0 .. FULL_LAYERS - 2 and the q/k/v
projection of layer FULL_LAYERS - 1, the probe, before the selection. The K/V of layer 0 depend
only on a token and its position, so a re-rotated copy already holds what computing it would
give, and no deviation shows there; from layer 1 on a copy misses the context before its
segment, and layer FULL_LAYERS - 1 = 1 is the first where the deviation says which copies are
most wrong. A model of at most FULL_LAYERS layers recomputes everything."""


def blend_copy_cost(num_layers: int) -> float:
    """A copied token left as it is runs through the layers before the probe and the probe's
    q/k/v projection, counted here as FULL_LAYERS whole layers (an upper bound): its share of a
    computed token's work, what the scheduler's step budget counts it as."""
    return min(1.0, FULL_LAYERS / num_layers)


@dataclass(frozen=True)
class BlendOutput:
    """A selective forward's result: final hidden states of the tokens that ran through every
    layer, and which those are."""

    hidden: torch.Tensor  # [R, hidden], after the final norm
    rows: torch.Tensor  # [R] int64: each one's index among the batch's packed new tokens, ascending
    recomputed: list[list[int]]  # per chunk, the positions of the copied tokens picked, ascending


def slots_of(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat KV slots of `positions` in a request or segment holding `pages` (1-D) in order."""
    return pages[positions // page_size] * page_size + positions % page_size


def copy_segment_kv(
    pool: KVPool, rotary: RotaryEmbedding, src: torch.Tensor, dst: torch.Tensor, deltas: torch.Tensor
) -> None:
    """For every layer, K/V of slots `src` into slots `dst` (int64 [N] each), the key of row i
    rotated by `deltas[i]` positions (its target position minus its source position): rotated in
    fp32 and stored in the pool's format (a quantized key is dequantized, rotated and quantized
    again, its scale with it). A row with delta 0, and every value, is copied bit for bit."""
    moved = deltas.nonzero().squeeze(1)
    if len(moved):
        cos, sin = rotary(deltas[moved], torch.float32)  # rotary in a rotation's angle: additive
    for layer in range(pool.num_layers):
        k_pool, v_pool = pool.flat_k(layer), pool.flat_v(layer)
        k_scales, v_scales = pool.flat_scales(layer)
        k = k_pool.index_select(0, src)
        ks = None if k_scales is None else k_scales.index_select(0, src)
        if len(moved):
            kf = dequantize(k[moved], None if ks is None else ks[moved], pool.format)
            rotated, scales = quantize(apply_rotary(kf, cos, sin), pool.format)
            k[moved] = rotated
            if ks is not None:
                ks[moved] = scales
        raw(k_pool).index_copy_(0, dst, raw(k))
        raw(v_pool).index_copy_(0, dst, raw(v_pool.index_select(0, src)))
        if ks is not None:
            k_scales.index_copy_(0, dst, ks)
            v_scales.index_copy_(0, dst, v_scales.index_select(0, src))


def check_runs(prefix_len: int, num_tokens: int, reuse: Sequence[SegmentReuse], page_size: int) -> None:
    """Raise ValueError unless the runs keep `SegmentReuse`'s and `Chunk.reuse`'s contract for a
    chunk of `num_tokens` tokens from `prefix_len`: in position order, apart, wholly inside the
    chunk, recompute within 0 .. length, pages enough for the source."""
    end = prefix_len
    for run in reuse:
        if run.length < 1 or not 0 <= run.recompute <= run.length or run.source_position < 0:
            raise ValueError(f"segment run {run}: needs length >= 1, 0 <= recompute <= length, source_position >= 0")
        if run.position < end or run.position + run.length > prefix_len + num_tokens:
            raise ValueError(
                f"segment run {run}: runs must be in position order, apart, and inside the chunk "
                f"(positions {prefix_len} .. {prefix_len + num_tokens - 1})"
            )
        if len(run.pages) * page_size < run.source_position + run.length:
            raise ValueError(f"segment run {run}: {len(run.pages)} pages of {page_size} cannot hold its source")
        end = run.position + run.length


@torch.inference_mode()
def blend_forward(
    model: LlamaForCausalLM, backend: AttentionBackend, page_table: torch.Tensor, prefix_lens: list[int],
    token_ids: list[list[int]], reuse: list[Sequence[SegmentReuse]],
) -> BlendOutput:
    """The selective forward (the module docstring) of one step's chunks, in one pass: chunk i
    is `token_ids[i]` at positions prefix_lens[i] .. of the request whose pages are row i of
    `page_table` ([B, W] int64); `reuse[i]` its runs (empty for a chunk without any, which runs
    through every layer as in a plain forward)."""
    pool = backend.pool
    device, ps = pool.device, pool.page_size
    lens = [len(t) for t in token_ids]
    for prefix, n, runs in zip(prefix_lens, lens, reuse, strict=True):
        check_runs(prefix, n, runs, ps)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lens, strict=True)]).to(device)
    whole = AttentionBatch(ps, page_table, prefix_lens, lens)
    num_layers = len(model.layers)
    everything = torch.arange(starts[-1], device=device)
    if num_layers <= FULL_LAYERS or not any(reuse):  # every token through every layer: no copy is kept
        backend.plan(whole)
        return BlendOutput(model(input_ids, positions, backend), everything, [[] for _ in lens])

    # the runs' tokens: where they go (their requests' slots), where their copies come from, and
    # their index among the packed tokens
    dst, src, deltas, packed = [], [], [], []
    for i, runs in enumerate(reuse):
        for r in runs:
            targets = torch.arange(r.position, r.position + r.length, device=device)
            dst.append(slots_of(page_table[i], targets, ps))
            source = torch.arange(r.source_position, r.source_position + r.length, device=device)
            src.append(slots_of(torch.tensor(r.pages, dtype=torch.int64, device=device), source, ps))
            deltas.append(torch.full((r.length,), r.position - r.source_position, device=device))
            packed.append(targets - prefix_lens[i] + starts[i])
    dst_t, packed_t = torch.cat(dst), torch.cat(packed)
    copy_segment_kv(pool, model.rotary, torch.cat(src), dst_t, torch.cat(deltas))
    probe = FULL_LAYERS - 1
    copied_k, copied_v = pool.read(probe, dst_t, torch.float32)

    backend.plan(whole)
    h, cos, sin = model.embed(input_ids, positions)
    h, residual = model.run_layers(h, None, cos, sin, backend, 0, probe)
    residual, q, k, v = model.layers[probe].project(h, residual, cos, sin)
    # every token's K/V at the probe layer are its fresh ones: store them all
    slots = torch.cat([slots_of(page_table[i], torch.arange(p, p + n, device=device), ps)
                       for i, (p, n) in enumerate(zip(prefix_lens, lens, strict=True))])
    pool.store(probe, slots, k, v)

    fresh_k, fresh_v = k[packed_t], v[packed_t]
    deviation = (((fresh_k.float() - copied_k.float()) ** 2).sum((1, 2))
                 + ((fresh_v.float() - copied_v.float()) ** 2).sum((1, 2))).cpu()
    keep = torch.ones(starts[-1], dtype=torch.bool)  # the tokens that run through the later layers
    keep[packed_t.cpu()] = False
    recomputed: list[list[int]] = []
    at = 0
    for i, runs in enumerate(reuse):
        picked: list[int] = []
        for run in runs:
            # largest first; a stable sort leaves equal deviations in position order
            order = torch.sort(deviation[at : at + run.length], descending=True, stable=True).indices
            picked += sorted(run.position + int(j) for j in order[: run.recompute])
            at += run.length
        if picked:
            keep[torch.tensor(picked, dtype=torch.int64) - prefix_lens[i] + starts[i]] = True
        recomputed.append(picked)
    rows = keep.nonzero().squeeze(1)  # ascending
    if not len(rows):  # every token a copy kept as it is: nothing more to compute
        return BlendOutput(residual[:0], rows.to(device), recomputed)
    # the later layers' batch: each chunk's kept tokens, at their positions where some were left out
    chunks, extend, query = [], [], []
    for i, n in enumerate(lens):
        local = keep[starts[i] : starts[i + 1]].nonzero().squeeze(1)
        if len(local):
            chunks.append(i)
            extend.append(len(local))
            query.append(None if len(local) == n else (local + prefix_lens[i]).tolist())
    later = AttentionBatch(ps, page_table[chunks], [prefix_lens[i] for i in chunks], extend,
                           query if any(q is not None for q in query) else None)
    backend.plan(later)
    rows = rows.to(device)
    h, residual = model.layers[probe].attend(q[rows], k[rows], v[rows], residual[rows], backend)
    h, residual = model.run_layers(h, residual, cos[rows], sin[rows], backend, FULL_LAYERS, num_layers)
    return BlendOutput(model.final_norm(h, residual), rows, recomputed)
