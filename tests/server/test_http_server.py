"""The real server over HTTP: native /generate (SGLang's wire format), admin routes, metrics,
and aborting on disconnect. Greedy outputs must equal the in-process Engine's."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from http_helpers import (
    TINY_OPTIONS,
    assert_pages_balanced,
    metric_samples,
    raw_request,
    sse_events,
)

from radixserve import Engine
from radixserve.kernels import isa

GREEDY = {"temperature": 0.0}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Seven wizards quietly judge boxing matches in the hall",
    "A",
]
LONG_PROMPT = " ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 6)


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--debug-checks")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=1024, chunk_size=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_generate_one_prompt_matches_engine(client, engine):
    params = {**GREEDY, "max_new_tokens": 12}
    r = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": params})
    assert r.status_code == 200, r.text
    out = r.json()
    ref = engine.generate(PROMPTS[0], params)
    assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"} <= set(meta)
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
    assert meta["finish_reason"]["type"] in ("length", "stop") and "matched" in meta["finish_reason"]
    assert meta["e2e_latency"] > 0


def test_generate_batch_of_texts_and_of_ids_in_order(client, engine):
    params = {**GREEDY, "max_new_tokens": 6}
    refs = engine.generate(PROMPTS, params)
    out = client.post("/generate", json={"text": PROMPTS, "sampling_params": params}).json()
    assert isinstance(out, list) and [o["output_ids"] for o in out] == [r["output_ids"] for r in refs]
    assert [o["index"] for o in out] == [0, 1, 2]
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    out_ids = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
    assert [o["output_ids"] for o in out_ids] == [r["output_ids"] for r in refs]
    one = client.post("/generate", json={"input_ids": ids[1], "sampling_params": params}).json()
    assert one["output_ids"] == refs[1]["output_ids"]


def test_n_samples_per_prompt_are_consecutive_and_seeded(client):
    params = {"temperature": 1.0, "max_new_tokens": 5, "n": 3, "seed": 11}
    out = client.post("/generate", json={"text": PROMPTS[:2], "sampling_params": params}).json()
    assert len(out) == 6 and [o["index"] for o in out] == list(range(6))
    again = client.post("/generate", json={"text": PROMPTS[:2], "sampling_params": params}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    solo = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": params}).json()
    assert [o["output_ids"] for o in solo] == [o["output_ids"] for o in out[3:]]


def test_streaming_is_cumulative_with_meta_info_and_done(client, engine):
    params = {**GREEDY, "max_new_tokens": 10}
    with client.stream("POST", "/generate", json={"text": PROMPTS[1], "sampling_params": params, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events, done = sse_events(raw.split("\n"))
    assert done and len(events) >= 2
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all("meta_info" in e for e in events)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    ref = engine.generate(PROMPTS[1], params)
    assert events[-1]["text"] == ref["text"] and events[-1]["output_ids"] == ref["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_streaming_a_batch_tags_each_event_with_its_index(client, engine):
    params = {**GREEDY, "max_new_tokens": 4}
    with client.stream("POST", "/generate", json={"text": PROMPTS[:2], "sampling_params": params, "stream": True}) as r:
        events, done = sse_events(list(r.iter_lines()))
    assert done
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    refs = engine.generate(PROMPTS[:2], params)
    assert [finals[i]["output_ids"] for i in (0, 1)] == [r["output_ids"] for r in refs]


def test_repeated_prompt_reports_cached_tokens(client):
    client.post("/flush_cache")
    body = {"text": LONG_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 2}}
    first = client.post("/generate", json=body).json()["meta_info"]
    second = client.post("/generate", json=body).json()["meta_info"]
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == (second["prompt_tokens"] - 1) // 4 * 4 > 0


def test_logprobs_in_sglang_format(client, engine):
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    body = {
        "input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True,
    }
    meta = client.post("/generate", json=body).json()["meta_info"]
    ref = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None
    for got, want in zip(meta["output_token_logprobs"], ref["output_token_logprobs"]):
        assert got[1:] == want[1:] and abs(got[0] - want[0]) < 1e-4
        assert isinstance(got[2], str)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0][1] == meta["output_token_logprobs"][0][1]  # greedy = top-1


def test_stop_string_and_token_id(client, engine):
    base = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 16})
    text, ids = base["text"], base["output_ids"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": stop}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop_token_ids": [ids[3]]}}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}


def _metrics(client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return metric_samples(r.text)


def test_metrics_are_exposed_and_move_as_requests_complete(client):
    before = _metrics(client)
    for name in (
        "radixserve_num_running_requests", "radixserve_num_waiting_requests", "radixserve_kv_cache_usage_ratio",
        "radixserve_prompt_tokens_total", 'radixserve_cached_prompt_tokens_total{tier="memory"}',
        'radixserve_cached_prompt_tokens_total{tier="disk"}', "radixserve_generation_tokens_total",
        "radixserve_time_to_first_token_seconds_count", "radixserve_time_per_output_token_seconds_count",
        "radixserve_e2e_request_latency_seconds_count", "radixserve_segment_reused_tokens_total",
        "radixserve_segment_recomputed_tokens_total",
    ):
        assert name in before, name
    body = {"text": LONG_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 5, "ignore_eos": True}}
    client.post("/generate", json=body)
    client.post("/generate", json=body)
    after = _metrics(client)
    prompt_len = client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]["prompt_tokens"]
    assert after["radixserve_prompt_tokens_total"] - before["radixserve_prompt_tokens_total"] >= 2 * prompt_len
    assert after["radixserve_generation_tokens_total"] - before["radixserve_generation_tokens_total"] >= 10
    memory_hits = 'radixserve_cached_prompt_tokens_total{tier="memory"}'
    assert after[memory_hits] > before[memory_hits]
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        key = f"radixserve_{hist}_count"
        assert after[key] - before[key] == 2, hist
    assert after["radixserve_num_running_requests"] == 0


def test_generate_with_segments_reports_what_was_reused(client, engine):
    """With the segment cache on (the default): the answer's shape and its counts, in either
    order of the same documents."""
    from radixserve.tokenizer import encode, encode_continuation

    docs = [f"Document {i}: {' '.join(['river'] * (8 + i))}.\n" for i in range(3)]
    params = {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}
    for order in (docs, docs[::-1]):
        segments = [*order, "Question: which document is longest?"]
        r = client.post("/generate", json={"segments": segments, "sampling_params": params})
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        ids = encode(engine.tokenizer, segments[0]) + [t for s in segments[1:] for t in encode_continuation(engine.tokenizer, s)]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 4 and isinstance(out["text"], str)
        # the documents after the first are copied (the first sits at position 0: ordinary prefix),
        # whole pages of them, computed alone before the first request blends them
        assert 0 < meta["recomputed_tokens"] < meta["segment_tokens"] <= meta["cached_tokens"] < len(ids)
        assert meta["segment_tokens"] <= len(ids) - len(encode_continuation(engine.tokenizer, segments[-1]))


def test_flush_cache_empties_the_tree(client, server):
    client.post("/generate", json={"text": LONG_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert server.wait_idle()["pages"]["cached"] > 0
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["ok"] is True, r.text
    pages = server.info()["pages"]
    assert pages["cached"] == 0 and pages["free"] == pages["total"]
    again = client.post("/generate", json={"text": LONG_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 2}}).json()
    assert again["meta_info"]["cached_tokens"] == 0


def test_flush_cache_while_a_request_runs_is_a_409_error_and_its_pages_show_in_use(client, server):
    body = {"text": LONG_PROMPT, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 1500, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as stream:
        lines = stream.iter_lines()  # one iterator, kept: a dropped one closes the connection
        assert stream.status_code == 200 and next(lines).startswith("data: {")  # running now
        info = server.info()
        r = client.post("/flush_cache")
        assert [line for line in lines if line][-1] == "data: [DONE]"
    pages = info["pages"]
    assert info["requests"]["running"] == 1 and pages["in_use"] > 0, info
    assert pages["free"] + pages["evictable"] + pages["in_use"] == pages["total"], pages
    error = r.json()["error"]
    assert r.status_code == 409 and error["code"] == "requests_running" and "running" in error["message"], r.text
    assert_pages_balanced(server.wait_idle())


def test_server_info_and_health_and_models(client, server, tiny_dir):
    info = server.info()
    assert info["model"]["path"] == str(tiny_dir) and info["model"]["dtype"] == "float32"
    assert info["model"]["weight_format"] == "none"  # a Hugging Face folder: nothing to keep quantized
    assert info["options"]["page_size"] == 4 and info["options"]["api_key"] is None
    assert set(info["pages"]) == {"total", "free", "cached", "evictable", "in_use", "tokens"} and info["pages"]["total"] == 1024
    assert info["pages"]["tokens"] == 1024 * 4  # pages of 4
    assert set(info["pids"]) == {"server", "scheduler", "worker"} and info["pids"]["server"] == server.proc.pid
    assert info["cpu_isa"] == str(isa.selected_tier())  # the server inherits RADIXSERVE_CPU_ISA, if set
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [str(tiny_dir)]


def test_startup_log_names_model_dtype_device_pool_and_url(server, tiny_dir):
    log = server.log()
    assert str(tiny_dir) in log and "float32" in log and "cpu" in log
    assert f"CPU ISA {isa.selected_tier()}" in log
    assert "KV pool: 1024 pages x 4 tokens" in log
    assert f"http://127.0.0.1:{server.port}" in log


def _running_requests(server) -> int:
    info = server.info()
    return info["requests"]["running"] + info["requests"]["waiting"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_client_disconnect_aborts_the_request_and_frees_its_pages(server, stream):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}, "stream": stream}
    sock = raw_request(server.port, "/generate", json.dumps(body).encode())
    deadline = time.monotonic() + 10
    while _running_requests(server) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    if stream:
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    sock.close()  # hang up long before 1500 tokens
    info = server.wait_idle(timeout=5)
    assert_pages_balanced(info)


def test_api_docs_wire_format_of_errors(client):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "temperature" in error["message"]
    assert client.get("/no/such/route").json()["error"]["message"]
    assert client.get("/generate").status_code == 405


def _stop_string_completing_after(text: str, ends: list[int], min_new: int) -> tuple[str, int, int]:
    """A stop string that occurs in the first `min_new - 1` tokens' text and again in a match that
    completes at or after token `min_new`; returns it, where that later match begins, and how many
    tokens the request then generates (`ends[k]`: the text's length after k tokens)."""
    before = ends[min_new - 1]
    for size in (3, 2, 1):
        for start in range(before - size + 1):
            stop = text[start : start + size]
            if not stop.strip():
                continue
            later = text.find(stop, before - size + 1)  # the first match ending past `before`
            if later >= 0:
                tokens = next(k for k in range(min_new, len(ends)) if ends[k] >= later + size)
                return stop, later, tokens
    raise AssertionError(f"no stop string repeats in {text!r}")


def test_a_stop_string_before_min_new_tokens_is_text_and_the_later_match_trims(client, engine):
    """Observed: 13 tokens generated and the text " 7": the front cut at the first occurrence of
    the stop string, which min_new_tokens had let through, and the streamed text shrank. The
    scheduler now sends where the match that ended the request begins; the front cuts there."""
    prompt = PROMPTS[0]
    params = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    base = client.post("/generate", json={"text": prompt, "sampling_params": params}).json()
    ids, text = base["output_ids"], base["text"]
    ends = [len(engine.tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert ends[-1] == len(text) and "\ufffd" not in text  # token boundaries as the server's text has them
    min_new = 8
    stop, begins, tokens = _stop_string_completing_after(text, ends, min_new)
    assert text.find(stop) + len(stop) <= ends[min_new - 1]  # it also occurs before min_new_tokens
    params = {**GREEDY, "max_new_tokens": 24, "min_new_tokens": min_new, "stop": [stop]}
    out = client.post("/generate", json={"text": prompt, "sampling_params": params}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:tokens] and out["meta_info"]["completion_tokens"] == tokens
    assert out["text"] == text[:begins]
    with client.stream("POST", "/generate", json={"text": prompt, "sampling_params": params, "stream": True}) as r:
        events, done = sse_events(list(r.iter_lines()))
    texts = [e["text"] for e in events]
    assert done and all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1)), texts  # never shrinks
    assert texts[-1] == out["text"] and events[-1]["output_ids"] == out["output_ids"]
    kept = client.post("/generate", json={"text": prompt, "sampling_params": {**params, "no_stop_trim": True}}).json()
    assert kept["text"] == text[: ends[tokens]] and kept["text"][begins:].startswith(stop)


def test_prompt_logprobs_with_n_are_computed_once_and_shared(client, server):
    """n=4 with prompt logprobs recomputed the prompt for every sample (2,000 tokens: 59.5 s
    against 15 s for n=1, 0 cached tokens). Sample 0 computes it; the others hit its pages."""
    body = {
        "text": LONG_PROMPT + " once", "sampling_params": {**GREEDY, "n": 3, "max_new_tokens": 3},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    }
    before = _metrics(client)
    outs = client.post("/generate", json=body).json()
    after = _metrics(client)
    metas = [o["meta_info"] for o in outs]
    prompt_len = metas[0]["prompt_tokens"]
    shared = (prompt_len - 1) // 4 * 4
    assert [m["cached_tokens"] for m in metas] == [0, shared, shared]
    computed = after["radixserve_prompt_tokens_total"] - before["radixserve_prompt_tokens_total"]
    hits = 'radixserve_cached_prompt_tokens_total{tier="memory"}'
    computed -= after[hits] - before[hits]
    assert computed == 3 * prompt_len - 2 * shared
    assert len(metas[0]["input_token_logprobs"]) == len(metas[0]["input_top_logprobs"]) == prompt_len
    for m in metas[1:]:  # every sample shows the one computation
        assert m["input_token_logprobs"] == metas[0]["input_token_logprobs"]
        assert m["input_top_logprobs"] == metas[0]["input_top_logprobs"]
    assert [o["output_ids"] for o in outs[1:]] == [outs[0]["output_ids"]] * 2
    one = client.post("/generate", json={**body, "sampling_params": {**GREEDY, "max_new_tokens": 3}}).json()["meta_info"]
    assert [e[1] for e in one["input_token_logprobs"]] == [e[1] for e in metas[0]["input_token_logprobs"]]
    assert all(a[0] is b[0] is None or abs(a[0] - b[0]) < 1e-4
               for a, b in zip(one["input_token_logprobs"], metas[0]["input_token_logprobs"], strict=True))
    assert_pages_balanced(server.wait_idle())
