"""Segments on real servers over HTTP (`segments` on /generate; docs/cache.md): recomputing every
copied token gives a plain request's greedy output (fp32, page sizes 1 and 16); a blend's output
does not depend on what the cache held or on the order it was first seen in; a segment read
back from the disk tier gives the same output; and pages balance after aborts mid-blend.
test_segments_api.py has the API's shapes on every route, with the segment cache off."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from http_helpers import Server, assert_pages_balanced, metric_samples

from radixserve.tokenizer import encode, encode_continuation, load_tokenizer

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
INSTRUCTION = "Answer the question from the documents below.\n\n"
QUESTION = "Question: which document talks about the weather?\nAnswer:"
DOCS = [
    f"Document {i}: " + " ".join(f"{word}{i}" for word in ("alpha", "beta", "gamma", "delta", "epsilon") * (6 + i))
    for i in range(4)
]


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    """Four layers, so the blend's selective layers (after the first two) are exercised."""
    return tiny_model(num_hidden_layers=4)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model)


def _options(page_size: int, *extra: str) -> tuple[str, ...]:
    """A pool of 16,384 tokens: --debug-checks walks every page after every step."""
    return ("--dtype", "float32", "--page-size", str(page_size), "--kv-pages", str(16384 // page_size),
            "--chunk-size", "64", "--debug-checks", *extra)


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def server(request, start_server, model) -> Server:
    srv = start_server(model, *_options(request.param))
    srv.page_size = request.param
    return srv


def _segments(order: list[int]) -> list[str]:
    return [INSTRUCTION, *(DOCS[i] for i in order), QUESTION]


def _ids(tokenizer, pieces: list[str]) -> list[int]:
    """The prompt the server builds from segments: each piece tokenized alone, concatenated."""
    return encode(tokenizer, pieces[0]) + [t for p in pieces[1:] for t in encode_continuation(tokenizer, p)]


def _generate(srv: Server, **body) -> dict:
    r = httpx.post(srv.url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_recomputing_every_copied_token_gives_the_plain_output(server, tokenizer):
    warm = _generate(server, segments=_segments([0, 1, 2]), segment_recompute_ratio=1.0)
    for order in ([2, 0, 1], [1, 3, 0]):
        pieces = _segments(order)
        blended = _generate(server, segments=pieces, segment_recompute_ratio=1.0)
        plain = _generate(server, input_ids=_ids(tokenizer, pieces), cache_salt="plain")
        assert blended["output_ids"] == plain["output_ids"]
        meta = blended["meta_info"]
        assert meta["prompt_tokens"] == plain["meta_info"]["prompt_tokens"]
        assert meta["segment_tokens"] > 0 and meta["recomputed_tokens"] == meta["segment_tokens"]
        assert meta["cached_tokens"] >= meta["segment_tokens"]
    assert warm["output_ids"]
    assert_pages_balanced(server.wait_idle())


def test_a_blend_does_not_depend_on_what_the_cache_held(server):
    body = {"segments": _segments([3, 1]), "segment_recompute_ratio": 0.3}
    first = _generate(server, **body)  # its segments computed alone first, then blended
    again = _generate(server, **body)  # from the segment cache
    httpx.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    flushed = _generate(server, **body)
    assert first["output_ids"] == again["output_ids"] == flushed["output_ids"]
    assert again["meta_info"]["segment_tokens"] == first["meta_info"]["segment_tokens"] > 0
    samples = metric_samples(httpx.get(server.url + "/metrics", timeout=30).text)
    assert samples["radixserve_segment_reused_tokens_total"] > 0
    assert 0 < samples["radixserve_segment_recomputed_tokens_total"] < samples["radixserve_segment_reused_tokens_total"]


def test_a_segment_read_back_from_disk_gives_the_same_output(start_server, model, tmp_path):
    # 40 pages of 16: two prompts' segments do not fit beside a flood of other documents
    srv = start_server(model, *_options(16, "--kv-pages", "40", "--kv-disk-dir", str(tmp_path / "kv")))
    body = {"segments": _segments([0, 2]), "segment_recompute_ratio": 0.15}
    in_memory = _generate(srv, **body)
    for i in range(6):  # other documents push the segments out of the pool, onto disk
        _generate(srv, text=f"Filler {i}: " + " ".join(f"w{i}x{j}" for j in range(120)))
    before = metric_samples(httpx.get(srv.url + "/metrics", timeout=30).text)
    from_disk = _generate(srv, **body)
    after = metric_samples(httpx.get(srv.url + "/metrics", timeout=30).text)
    assert after["radixserve_kv_disk_loaded_bytes_total"] > before["radixserve_kv_disk_loaded_bytes_total"]
    assert from_disk["output_ids"] == in_memory["output_ids"]
    assert_pages_balanced(srv.wait_idle())


def test_aborts_mid_blend_leave_the_pages_balanced(server):
    # long prompts (several chunks of 64 tokens): hung up on while their prompt is computed,
    # then after the first token
    for order, events in (([0, 1, 2, 3], 0), ([3, 2, 1, 0], 1)):
        body = {"segments": _segments(order), "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 64}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if seen >= events:
                    break
                if line.startswith("data:") and line != "data: [DONE]":
                    json.loads(line[5:])
                    seen += 1
    assert_pages_balanced(server.wait_idle())


def test_segments_with_n_logprobs_and_a_regex(server):
    out = _generate(server, segments=_segments([2, 1]), return_logprob=True, top_logprobs_num=2,
                    sampling_params={**GREEDY, "n": 2, "regex": "[ab]{4}"})
    assert len(out) == 2
    assert out[0]["output_ids"] == out[1]["output_ids"]
    for sample in out:
        assert len(sample["text"]) == 4 and set(sample["text"]) <= {"a", "b"}
        assert sample["meta_info"]["segment_tokens"] > 0
        assert len(sample["meta_info"]["output_token_logprobs"]) == len(sample["output_ids"])


def test_pinned_segments_are_reused_without_being_computed_again(server):
    docs = [DOCS[1], DOCS[3]]
    r = httpx.post(server.url + "/cache/pin", json={"segments": docs, "cache_salt": "pinned"}, timeout=120)
    assert r.status_code == 200, r.text
    pins = r.json()["pins"]
    assert len(pins) == 2 and all(p["segment"] and p["cache_salt"] == "pinned" and p["tokens"] > 0 for p in pins)
    listed = httpx.get(server.url + "/cache/pins", timeout=30).json()["pins"]
    assert {p["pin_id"] for p in pins} <= {p["pin_id"] for p in listed}
    body = {"segments": _segments([3, 1]), "cache_salt": "pinned"}
    out = _generate(server, **body)
    assert out["meta_info"]["segment_tokens"] >= sum(p["tokens"] for p in pins)
    # a flush keeps pinned pages: the same request still reuses them
    httpx.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    assert _generate(server, **body)["output_ids"] == out["output_ids"]
    bad = httpx.post(server.url + "/cache/pin", json={"segments": docs, "text": "x"}, timeout=30)
    assert bad.status_code == 400 and "segments" in bad.text
    r = httpx.post(server.url + "/cache/unpin", json={"segments": docs, "cache_salt": "pinned"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["unpinned"]) == 2
    assert_pages_balanced(server.wait_idle())


def test_speculative_decoding_keeps_a_blends_greedy_output(start_server, model, server):
    spec = start_server(model, *_options(server.page_size, "--speculative-algorithm", "ngram"))
    body = {"segments": _segments([2, 3, 0]), "segment_recompute_ratio": 0.15,
            "sampling_params": {**GREEDY, "max_new_tokens": 32}}
    with_spec, plain = _generate(spec, **body), _generate(server, **body)
    assert with_spec["output_ids"] == plain["output_ids"]
    assert with_spec["meta_info"]["segment_tokens"] == plain["meta_info"]["segment_tokens"] > 0
