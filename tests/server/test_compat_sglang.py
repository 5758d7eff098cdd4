"""Contract tests: SGLang's native wire format, as SGLang's own clients parse it.

The payloads below are what `sglang.lang.backend.runtime_endpoint.RuntimeEndpoint` and
`sglang.benchmark.serving` (the `--backend sglang` request function) send, copied from SGLang
0.5.x, and the assertions are what those clients read back. See docs/compatibility.md.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from http_helpers import (
    TINY_OPTIONS,
    assert_pages_balanced,
    raw_request,
    sse_events,
)

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0.0}

# RuntimeEndpoint.generate: global_config's two flags, then SglSamplingParams.to_srt_kwargs()
RUNTIME_ENDPOINT_SAMPLING = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "max_new_tokens": 8, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
    "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
    "regex": None, "json_schema": None,
}


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _generate(client: httpx.Client, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client: httpx.Client, **body) -> tuple[list[dict], bool, list[str]]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    events, done = sse_events(lines)
    return events, done, lines


def test_runtime_endpoint_payloads_are_accepted(client):
    """Exactly what RuntimeEndpoint sends for gen, cache_prefix and select."""
    out = _generate(client, text=PROMPT, sampling_params=RUNTIME_ENDPOINT_SAMPLING)
    assert isinstance(out["text"], str) and out["meta_info"]["completion_tokens"] <= 8
    cached = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 0})
    assert cached["text"] == "" and cached["meta_info"]["prompt_tokens"] > 0
    start = max(cached["meta_info"]["prompt_tokens"] - 2, 0)
    scored = _generate(
        client, text=[PROMPT + c for c in (" yes", " no")],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True, return_text_in_logprobs=True, logprob_start_len=start,
    )
    assert isinstance(scored, list) and len(scored) == 2
    for r in scored:
        entries = r["meta_info"]["input_token_logprobs"]
        assert len(entries) == r["meta_info"]["prompt_tokens"] - start
        assert isinstance(entries[0][-1], str)  # select() reads the healed token's text
        assert r["meta_info"]["output_token_logprobs"] == []
    ids = [[e[1] for e in r["meta_info"]["input_token_logprobs"]] for r in scored]
    # as in SGLang, logprob_start_len absent (-1) means output logprobs only; 0 means all
    uncond = _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True)
    assert [r["meta_info"]["input_token_logprobs"] for r in uncond] == [[], []]
    uncond = _generate(client, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in uncond] == [len(i) for i in ids]


def test_bench_serving_payload_is_accepted(client):
    """sglang.benchmark.serving's async_request_sglang_generate body, streaming."""
    body = {
        "text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        "lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
    }
    events, done, _ = _stream(client, **body)
    assert done and events[-1]["meta_info"]["completion_tokens"] == 6
    assert events[-1]["meta_info"]["prompt_tokens"] > 0


def test_streaming_text_is_cumulative_with_meta_info_and_done(client):
    full = _generate(client, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12, "ignore_eos": True})
    events, done, lines = _stream(client, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12, "ignore_eos": True})
    assert done and [line for line in lines if line][-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines if line)
    texts = [e["text"] for e in events]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # whole text so far
    assert texts[-1] == full["text"]
    assert all("meta_info" in e and e["meta_info"]["id"] == events[0]["meta_info"]["id"] for e in events)
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 12
    assert [e["meta_info"]["finish_reason"] for e in events][-1]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    # RuntimeEndpoint.generate_stream slices off what it already has
    pos, pieces = 0, []
    for e in events:
        pieces.append(e["text"][pos:])
        pos += len(pieces[-1])
    assert "".join(pieces) == full["text"]


def test_batches_return_lists_in_order_with_per_prompt_params(client):
    prompts = [PROMPT, "Seven wizards", "A"]
    singles = [_generate(client, text=p, sampling_params={**GREEDY, "max_new_tokens": n}) for p, n in zip(prompts, (3, 4, 5))]
    batch = _generate(client, text=prompts, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in (3, 4, 5)])
    assert [b["text"] for b in batch] == [s["text"] for s in singles]
    assert [b["index"] for b in batch] == [0, 1, 2]
    one_dict = _generate(client, text=prompts, sampling_params={**GREEDY, "max_new_tokens": 2})
    assert len(one_dict) == 3 and all(b["meta_info"]["completion_tokens"] <= 2 for b in one_dict)
    ids = [s["meta_info"]["prompt_tokens"] for s in singles]
    assert ids == [b["meta_info"]["prompt_tokens"] for b in batch]


def test_logprob_triples(client):
    body = dict(text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True, logprob_start_len=0)
    plain = _generate(client, **body)["meta_info"]
    prompt_len = plain["prompt_tokens"]
    assert len(plain["input_token_logprobs"]) == prompt_len
    assert plain["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    for lp, tid, text in plain["input_token_logprobs"][1:] + plain["output_token_logprobs"]:
        assert isinstance(lp, float) and lp <= 0 and isinstance(tid, int) and text is None
    assert "input_top_logprobs" not in plain and "output_top_logprobs" not in plain

    texts = _generate(client, **body, return_text_in_logprobs=True, top_logprobs_num=2)
    meta = texts["meta_info"]
    assert "".join(t for _, _, t in meta["output_token_logprobs"]) == texts["text"]
    assert [e[1] for e in meta["output_token_logprobs"]] == texts["output_ids"]
    assert len(meta["output_top_logprobs"]) == 3 and len(meta["input_top_logprobs"]) == prompt_len
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and all(len(t) == 3 and isinstance(t[2], str) for t in top)
        assert top[0][1] == chosen[1]  # greedy: the best alternative is the chosen token

    later = _generate(client, **{**body, "logprob_start_len": prompt_len - 3})["meta_info"]
    assert [e[1] for e in later["input_token_logprobs"]] == [e[1] for e in plain["input_token_logprobs"][-3:]]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(later["input_token_logprobs"], plain["input_token_logprobs"][-3:]))


def test_max_new_tokens_zero_returns_prompt_logprobs_only(client):
    out = _generate(client, text=PROMPT, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["finish_reason"]["type"] == "length"


def test_sglang_sampling_keys_are_accepted(client):
    base = _generate(client, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 8, "ignore_eos": True})
    out = _generate(client, text=PROMPT, sampling_params={
        **GREEDY, "max_new_tokens": 8, "min_new_tokens": 2, "ignore_eos": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "no_stop_trim": True, "stop_token_ids": [base["output_ids"][5]],
        "stream_interval": 1, "sampling_seed": 3,
    })
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": base["output_ids"][5]}
    assert out["output_ids"] == base["output_ids"][:6]


def test_stop_regex_is_a_clear_400(client):
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"stop_regex": ["a+"]}})
    assert r.status_code == 400 and "not supported yet" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "stop_regex"


@pytest.mark.parametrize("key,value,check", [
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}),
     lambda text: json.loads(text)["n"] in (1, 2)),
    ("regex", "[0-9]{3}", lambda text: re.fullmatch("[0-9]{3}", text)),
    ("ebnf", 'root ::= "a" | "b"', lambda text: text in ("a", "b")),
])
def test_sglang_constrained_decoding_fields(client, key, value, check):
    """SGLang's own client sends these keys (null when unused); see tests/server/test_constrained.py."""
    out = _generate(client, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 32, key: value})
    assert check(out["text"]), out


def test_logit_bias_really_biases_greedy(client):
    base = _generate(client, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4, "ignore_eos": True})
    target = next(t for t in range(100, 200) if t not in base["output_ids"])
    out = _generate(client, text=PROMPT, sampling_params={
        **GREEDY, "max_new_tokens": 4, "ignore_eos": True, "logit_bias": {str(target): 100.0},
    })
    assert out["output_ids"] == [target] * 4
    banned = _generate(client, text=PROMPT, sampling_params={
        **GREEDY, "max_new_tokens": 4, "ignore_eos": True, "logit_bias": {str(base["output_ids"][0]): -100},
    })
    assert banned["output_ids"][0] != base["output_ids"][0]
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"logit_bias": {"x": 1}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_model_and_server_info_routes(client, server):
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["is_generation"] is True and info["model_path"] and info["tokenizer_path"]
    for path in ("/get_server_info", "/server_info"):
        info = client.get(path).json()
        assert info["model"]["context_len"] > 0 and "pages" in info
    assert client.get("/health_generate").status_code == 200
    assert client.post("/flush_cache").status_code in (200, 409)
    assert client.get("/flush_cache").status_code == 405  # POST only: any web page can make a browser GET


def test_abort_request_by_rid(server, client):
    rid = "compat-abort-me"
    most = client.get("/server_info").json()["model"]["context_len"] - 64
    body = {"text": PROMPT, "rid": rid, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": most, "ignore_eos": True}}
    events: list[dict] = []
    first = threading.Event()

    def read() -> None:
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    r = client.post("/abort_request", json={"rid": rid})
    assert r.status_code == 200
    reader.join(60)
    assert not reader.is_alive()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < most
    assert client.post("/abort_request", json={}).status_code == 400
    assert client.post("/abort_request", json={"rid": rid}).json() == {"aborted": 0}  # it is over


class _Reader(threading.Thread):
    """A streaming /generate read in the background: its status, events and first event."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.status: int | None = None
        self.events: list[dict] = []
        self.first = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/generate", json=self.body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
        self.first.set()

    def finals(self) -> dict[int, dict]:
        return {e.get("index", 0): e for e in self.events if e["meta_info"]["finish_reason"] is not None}


def test_a_client_rid_cannot_name_a_sample_inside_the_runtime(server, client):
    """Sample 1 of rid `x` was keyed `x#1` in the scheduler and worker: a client rid `x#1` hit it
    and the worker died (KeyError), 503 for good. Now every submission has an internal id."""
    body = {
        "text": ["Hello", "World"], "rid": ["x", "x#1"],
        "sampling_params": [{"n": 2, "max_new_tokens": 2}, {"max_new_tokens": 12, "ignore_eos": True}],
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["x", "x", "x#1"]
    assert out[2]["meta_info"]["completion_tokens"] == 12
    # two clients: `v` with n=2 running while `v#1` arrives
    first = _Reader(server.url, {"text": PROMPT, "rid": "v", "sampling_params": {"n": 2, "max_new_tokens": 30, "ignore_eos": True}})
    first.start()
    assert first.first.wait(60)
    second = _generate(client, text="World", rid="v#1", sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    first.join(60)
    assert first.status == 200 and sorted(first.finals()) == [0, 1]
    assert all(f["meta_info"]["completion_tokens"] == 30 for f in first.finals().values())
    assert second["meta_info"]["completion_tokens"] == 12 and second["meta_info"]["id"] == "v#1"
    assert client.get("/health").status_code == 200
    assert server.proc.poll() is None


def test_a_rid_in_flight_is_a_409_and_abort_counts_what_it_found(server, client):
    most = client.get("/server_info").json()["model"]["context_len"] - 64
    reader = _Reader(server.url, {"text": PROMPT, "rid": "busy", "sampling_params": {"n": 3, "max_new_tokens": most, "ignore_eos": True}})
    reader.start()
    assert reader.first.wait(60)
    r = client.post("/generate", json={"text": "hi", "rid": "busy"})
    assert r.status_code == 409 and "'busy'" in r.json()["error"]["message"], r.text
    r = client.post("/generate", json={"text": ["hi", "yo"], "rid": ["free", "busy"]})
    assert r.status_code == 409 and "'busy'" in r.json()["error"]["message"], r.text
    assert client.post("/abort_request", json={"rid": "no-such-request"}).json() == {"aborted": 0}
    assert client.post("/abort_request", json={"rid": "busy"}).json() == {"aborted": 1}
    reader.join(60)
    finals = reader.finals()
    assert sorted(finals) == [0, 1, 2] and all(f["meta_info"]["finish_reason"]["type"] == "abort" for f in finals.values())
    assert all(f["meta_info"]["completion_tokens"] < most for f in finals.values())


def test_reusing_a_rid_after_a_disconnect_gets_only_its_own_output(server, client):
    """A streams rid R and hangs up; B posts rid R at once. A's last outputs (its abort) must never
    reach B: B once got a 500 with n=4 (IndexError), and A's finish_reason and prompt_tokens with n=1."""
    params = {**GREEDY, "max_new_tokens": 5, "ignore_eos": True}
    ref = _generate(client, text="Hello", sampling_params=params)
    for n in (1, 4, 1, 4):
        sampling = {"n": n, "max_new_tokens": 1000, "ignore_eos": True}
        long = {"text": PROMPT, "rid": "reused", "stream": True, "sampling_params": sampling}
        sock = raw_request(server.port, "/generate", json.dumps(long).encode())
        sock.settimeout(60)
        received = b""
        while b"data: {" not in received:
            received += sock.recv(65536)
        sock.close()
        deadline = time.monotonic() + 30
        while True:  # until the front has seen the disconnect, R is still in use
            r = client.post("/generate", json={"text": "Hello", "rid": "reused", "sampling_params": params})
            if r.status_code not in (400, 409) or "in use" not in r.text or time.monotonic() > deadline:
                break
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"], out
        assert out["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert_pages_balanced(server.wait_idle())
