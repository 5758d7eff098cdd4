"""Segment blending on the worker (worker/blend.py): copies re-rotated exactly, the selective
forward equal to a plain one when everything is recomputed, the selection, chunking
independence, and the hooks in ModelRunner and Worker. Real tiny random fp32 models of 4
layers, head size 64 (so the CPU prefill kernel serves their attention where it builds)."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.protocol import SegmentReuse
from radixserve.worker.blend import FULL_LAYERS, blend_forward, copy_segment_kv, slots_of
from radixserve.worker.model_runner import SequenceChunk
from tests.unit.test_attention_backends import Harness as RunnerHarness

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A Llama of 4 layers, GQA 4/2, head size 64; and the same with Llama 3 rope scaling."""
    from conftest import save_tiny_model
    from transformers import LlamaConfig

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                  rms_norm_eps=1e-5)
    root = tmp_path_factory.mktemp("blend_models")
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "llama": save_tiny_model(LlamaConfig(**common), root / "llama", seed=3),
        "llama3_rope": save_tiny_model(LlamaConfig(**common, rope_parameters=llama3), root / "llama3", seed=4),
    }


class Harness(RunnerHarness):
    """The backend tests' runner on torch_native, over a shuffled page pool: requests and
    segments never get contiguous pages."""

    def __init__(self, model_dir, page_size: int, num_pages: int = 400) -> None:
        super().__init__(model_dir, page_size, "torch_native", num_pages)

    def plain(self, row: int, tokens: list[int], prefix_len: int = 0) -> torch.Tensor:
        """A plain forward of tokens[prefix_len:] in `row`: the last token's logits."""
        self.give_pages(row, len(tokens))
        return self.runner.forward([SequenceChunk(row, prefix_len, tokens[prefix_len:])]).last_logits[0]

    def blend(self, row: int, tokens: list[int], reuse: list[SegmentReuse], prefix_len: int = 0) -> torch.Tensor:
        self.give_pages(row, len(tokens))
        return self.runner.forward([SequenceChunk(row, prefix_len, tokens[prefix_len:], reuse=tuple(reuse))]).last_logits[0]

    def slots(self, row: int, start: int, stop: int) -> torch.Tensor:
        return slots_of(self.table.table[row], torch.arange(start, stop), self.page_size)

    def kv(self, row: int, start: int, stop: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots(row, start, stop)
        return self.pool.flat_k(layer)[slots].clone(), self.pool.flat_v(layer)[slots].clone()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(h: Harness, seg_row: int, position: int, length: int, recompute: int, source_position: int = 0) -> SegmentReuse:
    return SegmentReuse(position, length, source_position, h.table.pages(seg_row), recompute)


# A prompt of fresh and reused tokens: fresh 10 | segment A (30) | fresh 8 | segment B (25) | fresh 7
LAYOUT = [("fresh", 10), ("A", 30), ("fresh", 8), ("B", 25), ("fresh", 7)]


def _prompt(h: Harness, seg_rows: dict[str, int], recompute: dict[str, int]):
    """The prompt's tokens (segments computed standalone in their rows first) and its runs."""
    tokens: list[int] = []
    runs = []
    for i, (name, n) in enumerate(LAYOUT):
        if name == "fresh":
            tokens += _tokens(n, seed=100 + i)
            continue
        seg = _tokens(n, seed=200 + i)
        h.plain(seg_rows[name], seg)
        runs.append(_run(h, seg_rows[name], len(tokens), n, recompute[name]))
        tokens += seg
    return tokens, runs


@pytest.mark.parametrize("page_size", [1, 16])
def test_recomputing_everything_equals_a_plain_forward(model_dirs, page_size):
    h = Harness(model_dirs["llama"], page_size)
    tokens, runs = _prompt(h, {"A": 1, "B": 2}, {"A": 30, "B": 25})
    plain = h.plain(3, tokens)
    blended = h.blend(4, tokens, runs)
    torch.testing.assert_close(blended, plain, atol=1e-4, rtol=1e-5)
    for layer in range(NUM_LAYERS):
        for ours, want in zip(h.kv(4, 0, len(tokens), layer), h.kv(3, 0, len(tokens), layer), strict=True):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_segment_reused_where_it_was_computed_is_its_standalone_kv(model_dirs, page_size):
    """Offset 0, recompute 0: the copies are the segment's K/V bit for bit, the later layers
    keep them, and the fresh tail sees what a plain forward's would."""
    h = Harness(model_dirs["llama"], page_size)
    segment, tail = _tokens(30, 1), _tokens(6, 2)
    h.plain(1, segment)
    logits = h.blend(2, segment + tail, [_run(h, 1, 0, 30, 0)])
    for layer in range(NUM_LAYERS):
        ours, want = h.kv(2, 0, 30, layer), h.kv(1, 0, 30, layer)
        if layer >= FULL_LAYERS:
            assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1]), layer
        elif h.backend.uses_prefill_kernel:  # recomputed over the same context, each row's sums its own
            assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1]), layer
        else:
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, h.plain(3, segment + tail), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("model", ["llama", "llama3_rope"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_re_rotated_keys_equal_keys_computed_at_the_new_positions(model_dirs, model, page_size):
    """Layer 0's K/V depend only on token and position: a segment copied to positions p.. has
    the K/V a forward computes there (rope scaling included), with delta 0 copied exactly."""
    h = Harness(model_dirs[model], page_size)
    prefix, segment = _tokens(45, 1), _tokens(30, 2)
    h.plain(1, segment)
    h.plain(2, prefix + segment)  # the segment at positions 45 .. 74
    h.give_pages(3, 75)
    src, dst = h.slots(1, 0, 30), h.slots(3, 45, 75)
    copy_segment_kv(h.pool, h.model.rotary, src, dst, torch.full((30,), 45))
    k, v = h.kv(3, 45, 75, 0)
    want_k, want_v = h.kv(2, 45, 75, 0)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, want_v, atol=1e-6, rtol=1e-6)
    # back again: a negative delta undoes it
    h.give_pages(4, 30)
    copy_segment_kv(h.pool, h.model.rotary, dst, h.slots(4, 0, 30), torch.full((30,), -45))
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(h.kv(4, 0, 30, layer), h.kv(1, 0, 30, layer), atol=1e-5, rtol=1e-5)
    # by 0, beside rotated rows: bit for bit
    h.give_pages(5, 30)
    deltas = torch.tensor([0, 7] * 15)
    copy_segment_kv(h.pool, h.model.rotary, src, h.slots(5, 0, 30), deltas)
    for layer in range(NUM_LAYERS):
        got, want = h.kv(5, 0, 30, layer), h.kv(1, 0, 30, layer)
        assert torch.equal(got[0][::2], want[0][::2]) and torch.equal(got[1], want[1])
        assert not torch.equal(got[0][1::2], want[0][1::2])


@pytest.mark.parametrize("page_size", [1, 16])
def test_selection_picks_the_largest_deviations_and_keeps_the_rest_copied(model_dirs, page_size):
    h = Harness(model_dirs["llama"], page_size)
    tokens, runs = _prompt(h, {"A": 1, "B": 2}, {"A": 7, "B": 0})
    # what the selection compares: a plain forward's layer FULL_LAYERS - 1 (the full layers
    # compute exactly that) against the copies
    h.plain(3, tokens)
    h.give_pages(5, len(tokens))
    for run in runs:
        src = slots_of(torch.tensor(run.pages), torch.arange(run.length), page_size)
        copy_segment_kv(h.pool, h.model.rotary, src, h.slots(5, run.position, run.position + run.length),
                        torch.full((run.length,), run.position))
    h.give_pages(4, len(tokens))
    result = blend_forward(h.model, h.backend, h.table.gather([4]), [0], [tokens], [runs])
    want: list[int] = []
    for run in runs:
        span = (run.position, run.position + run.length)
        fresh, copied = h.kv(3, *span, FULL_LAYERS - 1), h.kv(5, *span, FULL_LAYERS - 1)
        deviation = ((fresh[0] - copied[0]) ** 2).sum((1, 2)) + ((fresh[1] - copied[1]) ** 2).sum((1, 2))
        top = deviation.argsort(descending=True)[: run.recompute]
        assert deviation.unique().numel() == run.length  # no ties to blur the check
        want += sorted(run.position + int(j) for j in top)
    assert result.recomputed == [want] and len(want) == 7
    picked = set(want)
    for layer in range(FULL_LAYERS, NUM_LAYERS):
        for run in runs:
            for pos in range(run.position, run.position + run.length):
                ours, copy = h.kv(4, pos, pos + 1, layer), h.kv(5, pos, pos + 1, layer)
                same = torch.equal(ours[0], copy[0]) and torch.equal(ours[1], copy[1])
                assert same != (pos in picked), (layer, pos)


def test_recompute_zero_leaves_the_copies_in_the_later_layers(model_dirs):
    h = Harness(model_dirs["llama"], 16)
    tokens, runs = _prompt(h, {"A": 1, "B": 2}, {"A": 0, "B": 0})
    h.give_pages(5, len(tokens))
    for run in runs:
        src = slots_of(torch.tensor(run.pages), torch.arange(run.length), 16)
        copy_segment_kv(h.pool, h.model.rotary, src, h.slots(5, run.position, run.position + run.length),
                        torch.full((run.length,), run.position))
    h.blend(4, tokens, runs)
    for layer in range(FULL_LAYERS, NUM_LAYERS):
        for run in runs:
            span = (run.position, run.position + run.length)
            assert all(torch.equal(a, b) for a, b in zip(h.kv(4, *span, layer), h.kv(5, *span, layer), strict=True))


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunking_between_runs_changes_nothing(model_dirs, page_size):
    """One chunk, or two split between runs (as a crash-resumed request may be): the same KV in
    every layer and the same logits, bit for bit, where the C kernels serve (each row's sums
    are its own there). Every chunk and every recomputed subset is longer than SHORT_EXTEND,
    so the same rows take the same attention kernel both ways."""
    h = Harness(model_dirs["llama"], page_size)
    if not (h.backend.uses_prefill_kernel and h.backend.uses_cpu_kernel):
        pytest.skip("needs the CPU attention kernels at head size 64")
    fresh = [_tokens(20, 10 + i) for i in range(3)]
    seg_a, seg_b = _tokens(40, 20), _tokens(40, 21)
    h.plain(1, seg_a)
    h.plain(2, seg_b)
    tokens = fresh[0] + seg_a + fresh[1] + seg_b + fresh[2]
    run_a, run_b = _run(h, 1, 20, 40, 20), _run(h, 2, 80, 40, 20)
    whole = h.blend(3, tokens, [run_a, run_b])
    h.give_pages(4, len(tokens))
    first = h.runner.forward([SequenceChunk(4, 0, tokens[:80], reuse=(run_a,))])
    second = h.runner.forward([SequenceChunk(4, 80, tokens[80:], reuse=(run_b,))])
    assert first.all_logits == [None]
    assert torch.equal(second.last_logits[0], whole)
    for layer in range(NUM_LAYERS):
        for a, b in zip(h.kv(3, 0, len(tokens), layer), h.kv(4, 0, len(tokens), layer), strict=True):
            assert torch.equal(a, b), layer


def test_runs_are_checked(model_dirs):
    h = Harness(model_dirs["llama"], 16)
    segment = _tokens(20, 1)
    h.plain(1, segment)
    tokens = _tokens(5, 2) + segment + _tokens(5, 3)
    h.give_pages(2, len(tokens))
    pages = h.table.pages(1)
    bad = [
        ([SegmentReuse(5, 20, 0, pages, 21)], "recompute"),
        ([SegmentReuse(11, 20, 0, pages, 0)], "inside the chunk"),  # past the chunk's end
        ([SegmentReuse(5, 10, 0, pages, 0), SegmentReuse(10, 10, 10, pages, 0)], "position order"),
        ([SegmentReuse(5, 20, 0, [], 0)], "cannot hold"),
    ]
    for reuse, match in bad:
        with pytest.raises(ValueError, match=match):
            h.runner.forward([SequenceChunk(2, 0, tokens, reuse=tuple(reuse))])
    with pytest.raises(ValueError, match="last token's logits"):
        h.runner.forward([SequenceChunk(2, 0, tokens, all_logits=True, reuse=(SegmentReuse(5, 20, 0, pages, 0),))])
    # a chunk inside the prompt may end on a copy: nothing samples after it, it has no logits
    out = h.runner.forward([SequenceChunk(2, 0, tokens[:25], reuse=(SegmentReuse(5, 20, 0, pages, 0),))])
    assert out.last_logits.shape[0] == 1 and torch.isnan(out.last_logits).all()


def test_a_model_of_full_layers_only_recomputes_everything(tmp_path):
    from conftest import save_tiny_model
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=FULL_LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    h = Harness(save_tiny_model(config, tmp_path / "m"), 16)
    segment, tail = _tokens(20, 1), _tokens(4, 2)
    h.plain(1, segment)
    torch.testing.assert_close(h.blend(2, tail + segment + tail, [_run(h, 1, 4, 20, 0)]),
                               h.plain(3, tail + segment + tail), atol=1e-4, rtol=1e-5)


def test_a_mixed_step_keeps_chunk_order(model_dirs):
    """Plain chunks and a chunk with reuse in one selective forward: each output where its
    chunk is, every one as if run alone."""
    h = Harness(model_dirs["llama"], 16)
    tokens, runs = _prompt(h, {"A": 1, "B": 2}, {"A": 5, "B": 5})
    other, third = _tokens(33, 7), _tokens(12, 8)
    alone = [h.plain(5, other), h.blend(6, tokens, runs), h.plain(7, third)]
    for row, n in ((8, len(other)), (9, len(tokens)), (10, len(third))):
        h.give_pages(row, n)
    out = h.runner.forward([SequenceChunk(8, 0, other), SequenceChunk(9, 0, tokens, reuse=tuple(runs)),
                            SequenceChunk(10, 0, third, all_logits=True)])
    assert out.all_logits[0] is None and out.all_logits[1] is None and out.all_logits[2].shape[0] == 12
    for got, want in zip(out.last_logits, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_worker_runs_reuse_and_refuses_it_with_a_draft(model_dirs):
    from radixserve.config import ServerConfig
    from radixserve.protocol import Chunk, ForwardBatch, NewRequest, SamplingParams
    from radixserve.worker.worker import Worker

    worker = Worker(ServerConfig(model=str(model_dirs["llama"]), device="cpu", dtype="float32", kv_pages=64,
                                 page_size=16, max_running_requests=4))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    segment, head, tail = _tokens(30, 1), _tokens(9, 2), _tokens(5, 3)
    worker.step(ForwardBatch(chunks=[Chunk("s#0", 0, 0, segment, sample=False)],
                             new_requests=[NewRequest("s#0", greedy)], assigned=[(0, [0, 1])]))
    prompt = head + segment + tail
    run = SegmentReuse(9, 30, 0, [0, 1], 3)
    out = worker.step(ForwardBatch(
        chunks=[Chunk("p#0", 2, 0, tail, sample=True), Chunk("r#0", 1, 0, prompt, sample=True, reuse=[run])],
        new_requests=[NewRequest("p#0", greedy), NewRequest("r#0", greedy)], assigned=[(1, [2, 3, 4]), (2, [5])],
    ))
    h = Harness(model_dirs["llama"], 16)
    h.plain(1, segment)
    want_r = h.blend(2, prompt, [_run(h, 1, 9, 30, 3)])
    want_p = h.plain(3, tail)
    assert [r.next_token_id for r in out.results] == [int(want_p.argmax()), int(want_r.argmax())]
    with pytest.raises(ValueError, match="draft"):
        worker.step(ForwardBatch(chunks=[Chunk("r#0", 1, 44, [1, 2], sample=True, draft_len=1, reuse=[run])]))


def test_copies_rotate_in_fp32_and_store_in_the_pool_dtype():
    """A bf16 pool: rows moved by 0 are copied bit for bit, the others are the fp32 rotation of
    their bf16 keys rounded once; values are never touched."""
    from radixserve.models.config import RopeConfig
    from radixserve.models.layers import RotaryEmbedding, apply_rotary

    pool = KVPool(2, 8, 4, 2, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    rotary = RotaryEmbedding(64, RopeConfig())
    src, dst = torch.arange(0, 6), torch.arange(12, 18)
    deltas = torch.tensor([0, 3, 0, 100, -2, 0])
    before = [(pool.flat_k(layer)[src].clone(), pool.flat_v(layer)[src].clone()) for layer in range(2)]
    copy_segment_kv(pool, rotary, src, dst, deltas)
    cos, sin = rotary(deltas, torch.float32)
    for layer, (k, v) in enumerate(before):
        want = apply_rotary(k.float(), cos, sin).to(torch.bfloat16)
        got = pool.flat_k(layer)[dst]
        assert torch.equal(got[deltas == 0], k[deltas == 0]) and torch.equal(got, want)
        assert torch.equal(pool.flat_v(layer)[dst], v)
