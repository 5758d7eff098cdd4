"""Segment blending on the worker (CacheBlend): a chunk whose runs of tokens take their KV from
cached segments, and the selective forward that repairs the most wrong of those copies.

A segment's KV is computed once standalone, at positions 0 .. L - 1, and cached. Reused at
another position of another request (`protocol.SegmentReuse`), its K/V are copied into the
request's pages for every layer, keys re-rotated by the offset (`copy_segment_kv`). The copies
ignore everything before the segment in the request, so they are wrong, and the more so the
deeper the layer. The selective forward for one chunk (`blend_chunk`):

1. layers 0 .. FULL_LAYERS - 1 run over every token of the chunk, as a plain forward would
   (they store fresh K/V for every token there);
2. in each run, the `recompute` tokens whose fresh K/V at layer FULL_LAYERS - 1 differ most
   from their copies (squared L2 of the K difference plus the V difference, over heads; ties
   to the earlier position) are picked;
3. layers FULL_LAYERS .. L - 1 run over the chunk's fresh tokens (those in no run; the prompt's
   last token always among them) and the picked ones only, at their scattered positions
   (`AttentionBatch.query_positions`), attending causally over the blended context; the other
   reused tokens keep their copies in those layers.

Every choice is made per run from values that depend only on the request's tokens before and
in the run, so a request chunked differently (a crash-resumed one), with chunk boundaries
between runs, blends to the same KV and logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionBackend, AttentionBatch
from radixserve.attention.kv_pool import KVPool
from radixserve.models.layers import RotaryEmbedding, apply_rotary
from radixserve.models.llama import LlamaForCausalLM
from radixserve.protocol import SegmentReuse

FULL_LAYERS = 2
"""Layers every token of a blended chunk runs through before the selection. The K/V of layer 0
depend only on a token and its position, so a re-rotated copy already holds what computing it
would give, and no deviation shows there; from layer 1 on a copy misses the context before its
segment, and layer FULL_LAYERS - 1 = 1 is the first where the deviation says which copies are
most wrong. A model of at most FULL_LAYERS layers recomputes everything."""


@dataclass(frozen=True)
class BlendResult:
    # [V] float32 after the chunk's last token; None when that token is a copy not recomputed
    # (a chunk inside the prompt: nothing samples after it)
    logits: torch.Tensor | None
    recomputed: list[int]  # positions of the reused tokens picked for recompute, ascending


def slots_of(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat KV slots of `positions` in a request or segment holding `pages` (1-D) in order."""
    return pages[positions // page_size] * page_size + positions % page_size


def copy_segment_kv(
    pool: KVPool, rotary: RotaryEmbedding, src: torch.Tensor, dst: torch.Tensor, deltas: torch.Tensor
) -> None:
    """For every layer, K/V of slots `src` into slots `dst` (int64 [N] each), the key of row i
    rotated by `deltas[i]` positions (its target position minus its source position): rotated in
    fp32, stored in the pool's dtype. A row with delta 0 is copied bit for bit."""
    moved = deltas.nonzero().squeeze(1)
    if len(moved):
        cos, sin = rotary(deltas[moved], torch.float32)  # rotary in a rotation's angle: additive
    for layer in range(pool.num_layers):
        k_pool, v_pool = pool.flat_k(layer), pool.flat_v(layer)
        k = k_pool.index_select(0, src)
        if len(moved):
            k[moved] = apply_rotary(k[moved].float(), cos, sin).to(pool.dtype)
        v = v_pool.index_select(0, src)
        k_pool.index_copy_(0, dst, k)
        v_pool.index_copy_(0, dst, v)


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
def blend_chunk(
    model: LlamaForCausalLM, backend: AttentionBackend, page_row: torch.Tensor, prefix_len: int,
    token_ids: list[int], reuse: Sequence[SegmentReuse],
) -> BlendResult:
    """The selective forward of one chunk with reuse (the module docstring): `token_ids` at
    positions prefix_len .., the request's pages `page_row` ([1, W] int64, enough for all of
    them; the first prefix_len positions already stored)."""
    pool = backend.pool
    device, ps, n = pool.device, pool.page_size, len(token_ids)
    check_runs(prefix_len, n, reuse, ps)
    input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(prefix_len, prefix_len + n, device=device)
    whole = AttentionBatch(ps, page_row, [prefix_len], [n])
    num_layers = len(model.layers)
    if num_layers <= FULL_LAYERS or not reuse:  # every token through every layer
        backend.plan(whole)
        hidden = model(input_ids, positions, backend)
        return BlendResult(model.compute_logits(hidden[-1:])[0], [])

    # the runs' tokens: where they go (the request's slots) and where their copies come from
    targets = torch.cat([torch.arange(r.position, r.position + r.length) for r in reuse]).to(device)
    dst = slots_of(page_row[0], targets, ps)
    src = torch.cat([
        slots_of(torch.tensor(r.pages, dtype=torch.int64, device=device),
                 torch.arange(r.source_position, r.source_position + r.length, device=device), ps)
        for r in reuse
    ])
    deltas = torch.cat([torch.full((r.length,), r.position - r.source_position) for r in reuse]).to(device)
    copy_segment_kv(pool, model.rotary, src, dst, deltas)
    probe = FULL_LAYERS - 1
    copied_k, copied_v = pool.flat_k(probe).index_select(0, dst), pool.flat_v(probe).index_select(0, dst)

    backend.plan(whole)
    h, cos, sin = model.embed(input_ids, positions)
    h, residual = model.run_layers(h, None, cos, sin, backend, 0, FULL_LAYERS)

    fresh_k, fresh_v = pool.flat_k(probe).index_select(0, dst), pool.flat_v(probe).index_select(0, dst)
    deviation = ((fresh_k.float() - copied_k.float()) ** 2).sum((1, 2)) + ((fresh_v.float() - copied_v.float()) ** 2).sum((1, 2))
    keep = torch.ones(n, dtype=torch.bool)  # the chunk's tokens run through the later layers
    keep[targets.cpu() - prefix_len] = False
    picked: list[int] = []
    at = 0
    for run in reuse:
        # largest first; a stable sort leaves equal deviations in position order
        order = torch.sort(deviation[at : at + run.length].cpu(), descending=True, stable=True).indices
        chosen = sorted(run.position + int(j) for j in order[: run.recompute])
        keep[torch.tensor(chosen, dtype=torch.int64) - prefix_len] = True
        picked += chosen
        at += run.length
    rows = keep.nonzero().squeeze(1)  # ascending
    if not len(rows):  # every token a copy kept as it is: nothing more to compute
        return BlendResult(None, picked)
    backend.plan(AttentionBatch(ps, page_row, [prefix_len], [len(rows)], [(rows + prefix_len).tolist()]))
    last_kept = bool(keep[-1])
    rows = rows.to(device)
    h, residual = model.run_layers(h[rows], residual[rows], cos[rows], sin[rows], backend, FULL_LAYERS, num_layers)
    if not last_kept:
        return BlendResult(None, picked)
    hidden = model.final_norm(h[-1:], residual[-1:])
    return BlendResult(model.compute_logits(hidden)[0], picked)
