"""The HTTP fuzzer (bench/robustness/fuzz/), bounded: a fixed plan of 400 requests over every route against a
tiny model, valid and hostile, some clients leaving, some slow, some bodies over the limit, and
the hostile classes of round two (tools, tool choices, deep and unenforceable schemas, pins,
requests a browser rule refuses), with the plain stream probe beside it.
Nothing may answer 5xx, hang, reset a connection it should answer, accept what the documented
rules refuse, kill or restart the engine, or leave a KV page held once idle. `python -m
bench.robustness.fuzz` (`make fuzz`) is the long run.

Against the runtime before 0271a41 this plan finds its bugs by itself: a rid `x#1` next to `x`
with n=2 kills the worker in the first few dozen requests; without that, an odd logit_bias key
("²") answers 500 and 1,025 stop_token_ids are accepted."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from http_helpers import TINY_OPTIONS

from bench.robustness.fuzz import (
    GENERATING,
    MODES,
    Answer,
    FuzzRequest,
    Outcome,
    Pad,
    Pairs,
    Raw,
    Target,
    draw_plan,
    encode,
    judge,
    must_refuse,
    print_report,
    run_plan,
    unexplained_aborts,
)
from bench.robustness.fuzz.plan import CROSS_ORIGIN_SHAPES, SHAPES
from bench.robustness.fuzz.request import KEEP_BYTES
from bench.robustness.fuzz.run import control_plan
from bench.robustness.fuzz.schemas import SCHEMA_SHAPES

REQUESTS = 400
SEED = 0
# hypothesis's draws for a seed also depend on the process (what else is imported and cached),
# so coverage is checked on a plan large enough to carry every known shape whatever ran before
COVERAGE_REQUESTS = 3000
BODY_LIMIT = 200_000  # big bodies at and past the limit stay cheap
# the hostile shapes the fuzzer exists for: a plan must carry each of them
KNOWN_SHAPES = (
    "logit_bias-odd-key", "stop", "stop_token_ids", "rid", "rid-family", "rid-repeated-in-batch",
    "rid-x#1-with-n2", "wrong-value", "unknown-field", "unknown-field-falsy", "deleted-field", "repeated-key",
    "body-not-object", "junk-body", "utf8-body", "long-prompt", "abort", "wrong-method", "unknown-route",
    "big-body", "over-limit", "grammar-good", "grammar-bad", *(f"mode-{m}" for m in MODES),
    # round two: each class, and each shape the plan deals of it
    *SHAPES, *(f"tools-{e}" for e in SHAPES["tools"]), *(f"tool_choice-{c}" for c in SHAPES["tool_choice"]),
    *(f"schema-deep-{s}" for s in SCHEMA_SHAPES), *(f"schema-{k}" for k in SHAPES["schema"] if k not in ("deep", "regex-deep")),
    "regex-deep", *(s for s in SHAPES["pin"] if s != "list"), *(s for s in CROSS_ORIGIN_SHAPES if s != "content-type"),
    "odd-content-type", "no-content-type",
)
HOSTILE_CLASSES = ("tools", "tool_choice", "schema", "pin", "cross-origin")
TARGET = Target(model_name="tiny", vocab_size=49152, context_len=2048, max_body_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--served-model-name", "tiny", "--max-body-bytes", str(BODY_LIMIT),
                        "--log-level", "warning")


def test_encode_writes_what_json_dumps_cannot():
    body = {"a": Raw("1" * 5000), "b": Pairs((("k", 1), ("k", "\ud800"))), "c": float("nan")}
    assert encode(body) == b'{"a":' + b"1" * 5000 + b',"b":{"k":1,"k":"\\ud800"},"c":NaN}'
    assert encode({"s": "\ud800"}, ascii_only=False) == b'{"s":"\xed\xa0\x80"}'  # not UTF-8: a lone surrogate
    assert len(encode({"text": Pad(1000)})) == 1000
    json.loads(encode({"text": Pad(1000), "n": [1, 2]}))


def test_a_request_encodes_its_body_once_until_judged():
    """The client and the oracle look at a body several times; a big one is encoded and read
    once while its request is in flight, then dropped (its size stays), a small one kept."""
    big = FuzzRequest("POST", "/generate", "/generate", {"text": "hi", "padding": Pad(KEEP_BYTES + 1)})
    raw, body = big.payload(), big.sent_json()
    assert big.payload() is raw and big.sent_json() is body and body["text"] == "hi"
    big.forget()
    assert big.size() == KEEP_BYTES + 1 and big.payload() is not raw and big.payload() == raw
    small = FuzzRequest("POST", "/generate", "/generate", {"text": "hi"})
    raw = small.payload()
    small.forget()
    assert small.payload() is raw and small.sent_json() == {"text": "hi"}
    assert FuzzRequest("POST", "/generate", "/generate", Raw("{")).sent_json() is None


def test_the_oracle_flags_what_it_must():
    gen = FuzzRequest("POST", "/generate", "/generate", {"text": "hi"})
    assert judge(gen, Answer(500, body=b'{"error": {"message": "boom"}}'), BODY_LIMIT)[0][0][0] == "5xx"
    assert judge(gen, Answer(503, body=b'{"error": {"message": "full", "code": "overloaded"}}'), BODY_LIMIT) == ([], "overloaded")
    assert judge(gen, Answer(400, body=b"Bad Request"), BODY_LIMIT)[0][0][0] == "bad-error-body"
    assert judge(gen, Answer(error="reset"), BODY_LIMIT)[0][0][0] == "connection"
    assert judge(gen, Answer(200, events=['{"text": "a"}']), BODY_LIMIT)[0][0][0] == "stream-unfinished"
    assert judge(gen, Answer(200, events=['{"error": {"message": "x"}}'], done=True), BODY_LIMIT)[0][0][0] == "stream-error"
    echo = json.dumps({"error": {"message": "no route /" + "a" * 4000}}).encode()
    assert judge(gen, Answer(404, body=echo), BODY_LIMIT)[0][0][0] == "long-error"
    big = FuzzRequest("POST", "/generate", "/generate", {"text": Pad(BODY_LIMIT + 1)})
    assert judge(big, Answer(error="reset"), BODY_LIMIT) == ([], "closed-over-limit")
    assert judge(big, Answer(400, body=b'{"error": {"message": "x"}}'), BODY_LIMIT)[0][0][0] == "limit-not-enforced"


@pytest.mark.parametrize("body", [
    {"text": "hi", "foo": 0},
    {"text": "hi", "image_data": "x.png"},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"\u00b2": 1}}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"--5": 1}}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 10**400}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 1e-45}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1, "stop_token_ids": [1] * 1025}},
    {"text": ["a", "b"], "rid": ["x", "x"]},
    {"text": "hi", "cache_salt": ""},
])
def test_must_refuse_knows_the_documented_rules(body):
    assert must_refuse("/generate", body, TARGET) is not None


def test_must_refuse_lets_valid_bodies_through():
    assert must_refuse("/generate", {"text": "hi", "image_data": None, "sampling_params": {"max_new_tokens": 1, "logit_bias": {"5": -100}, "top_k": 10**300}}, TARGET) is None
    assert must_refuse("/v1/chat/completions", {"messages": [], "max_tokens": -1, "max_completion_tokens": 2, "foo": 0}, TARGET) is None
    assert must_refuse("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 0}, TARGET) is not None


def test_an_abort_is_explained_only_by_an_abort_call_meanwhile():
    victim = Outcome(0, "/generate", 200, start=1.0, end=2.0, aborted=["x"])
    other_rid = Outcome(1, "/abort_request", 200, start=1.5, end=1.6, abort_call=("x#1", False))
    assert unexplained_aborts([victim, other_rid]) == [victim]
    same_rid = Outcome(2, "/abort_request", 200, start=1.5, end=1.6, abort_call=("x", False))
    assert unexplained_aborts([victim, same_rid]) == []
    too_late = Outcome(3, "/abort_request", 200, start=2.5, end=2.6, abort_call=(None, True))
    assert unexplained_aborts([victim, too_late]) == [victim]


def test_plan_is_deterministic_and_carries_every_known_shape():
    plan = draw_plan(TARGET, REQUESTS, SEED)
    assert [r.payload() for r in plan] == [r.payload() for r in draw_plan(TARGET, REQUESTS, SEED)]
    plan = draw_plan(TARGET, COVERAGE_REQUESTS, SEED)
    tags = {t for r in plan for t in r.tags}
    assert set(KNOWN_SHAPES) <= tags, set(KNOWN_SHAPES) - tags
    routes = {r.route for r in plan}
    assert {*GENERATING, "/abort_request", "(unknown)", "(wrong method)"} <= routes and len(routes) >= 12, routes
    bodies = b"\n".join(r.payload() for r in plan)
    for shape in (b"\\u00b2", b"--5", b"1e-45", b"1e308", b"NaN", b'"x#1"'):
        assert shape in bodies, shape
    assert re.search(rb"[0-9]{309}", bodies), "no integer past a float's range"


def test_fuzz_finds_nothing(server):
    plan = draw_plan(Target.from_server(server.url), REQUESTS, SEED)
    report = asyncio.run(run_plan(server.url, plan, concurrency=6, timeout=60))
    print_report(report)
    failures = json.dumps(report.failures[:5], indent=1)[:6000]
    found = f"{dict(report.problems)}, hangs {report.hangs}, after {report.after}"
    assert report.ok, f"{found}:\n{failures}\n{server.log()[-3000:]}"
    # the plan reached the server as meant: accepted and refused bodies, clients that left
    assert report.status_classes["2xx"] > 50 and report.status_classes["4xx"] > 50, report.status_classes
    assert report.notes["left"] > 0, report.notes
    assert report.after["idle"] and report.after["pages"]["in_use"] == 0, report.after
    # the hostile classes went out, and the browser rules answered theirs
    assert set(HOSTILE_CLASSES) <= set(report.by_tag), report.by_tag
    assert {"403", "405", "415", "421"} <= set(report.by_status), report.by_status
    # the plain stream probe timed its stream on the idle server and during the run
    probe = report.probe
    assert probe["idle"]["streams"] >= 1 and probe["idle"]["ends"] == {"ok": probe["idle"]["streams"]}, probe
    assert probe["during"]["streams"] >= 1 and probe["worst_gap_ratio"] is not None, probe
    # the control: the served requests of plain clients, sent again alone with the probe beside
    valid = control_plan(plan, report)
    assert 50 < len(valid) <= report.status_classes["2xx"] and all(r.mode == "plain" for r in valid)
    control = asyncio.run(run_plan(server.url, valid, concurrency=6, timeout=60))
    assert control.ok, f"{dict(control.problems)}: {json.dumps(control.failures[:5], indent=1)[:3000]}"
    # served once, served again (a pin past its tenant's budget or a flush may differ now)
    assert control.status_classes["2xx"] >= 0.9 * len(valid), control.by_status
    assert control.probe["during"]["streams"] >= 1, control.probe
