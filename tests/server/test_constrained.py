"""Constrained decoding on /generate: json_schema, regex, ebnf and structural_tag, through a real
server on a tiny random-weight model (its outputs are noise, so only the grammar can make them
valid), and the pieces under it: the compile cache, the bitmask the worker applies."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from http_helpers import TINY_OPTIONS, assert_pages_balanced, metric_samples, running_server

from radixserve import Engine
from radixserve.front.types import InvalidRequest
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.sampling import parse_sampling_params
from radixserve.protocol import Grammar
from radixserve.scheduler.grammar import GrammarBusy, GrammarCompiler, GrammarError, PendingGrammar
from radixserve.worker.sampler import apply_token_bitmasks

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
                                                "required": ["x"]}}, "required": ["inner"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"opt": {"type": "string", "maxLength": 3}, "req": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["req"]},
    {"type": "string", "maxLength": 10},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"pt": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                          {"const": "x"}], "items": False}}, "required": ["pt"]},
]


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--debug-checks")


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def generate(client: httpx.Client, constraint: dict, **params) -> httpx.Response:
    sampling = {"max_new_tokens": 96, "temperature": 0.0, **params, **constraint}
    return client.post("/generate", json={"text": "Answer:", "sampling_params": sampling})


def _metric(client: httpx.Client, name: str) -> float:
    return metric_samples(client.get("/metrics").text).get(name, 0.0)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_parses_and_validates(client, index):
    schema = SCHEMAS[index]
    r = generate(client, {"json_schema": json.dumps(schema)}, temperature=0.8, seed=index)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_output_fullmatches_greedy_sampled_and_n(client):
    pattern = r"[a-z]{3}-[0-9]{2,4}( ok)?"
    greedy = generate(client, {"regex": pattern})
    assert greedy.status_code == 200 and re.fullmatch(pattern, greedy.json()["text"]), greedy.text
    sampled = generate(client, {"regex": pattern}, temperature=1.0, n=3, seed=7).json()
    assert len(sampled) == 3 and all(re.fullmatch(pattern, s["text"]) for s in sampled), sampled


def test_ebnf_and_structural_tag(client):
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    out = generate(client, {"ebnf": ebnf}, temperature=1.0, seed=3).json()
    assert re.fullmatch(r"yes|no|maybe [0-9]", out["text"]), out
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "end": "</r>",
                                               "content": {"type": "json_schema", "json_schema": SCHEMAS[0],
                                                           "max_whitespace_cnt": 1}}}
    out = generate(client, {"structural_tag": json.dumps(tag)}).json()
    body = re.fullmatch(r"<r>(.*)</r>", out["text"], re.S)
    assert body is not None, out
    jsonschema.validate(json.loads(body.group(1)), SCHEMAS[0])


def test_streamed_constrained_text_equals_the_non_streamed(client):
    constraint = {"json_schema": json.dumps(SCHEMAS[1])}
    whole = generate(client, constraint).json()["text"]
    body = {"text": "Answer:", "stream": True, "sampling_params": {"max_new_tokens": 96, "temperature": 0.0, **constraint}}
    with client.stream("POST", "/generate", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["text"] == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[1])


def test_a_grammar_that_allows_anything_changes_no_greedy_token(client):
    free = client.post("/generate", json={"text": "Once upon", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}).json()
    constrained = client.post("/generate", json={"text": "Once upon", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, "regex": r"[\s\S]*"}}).json()
    assert constrained["output_ids"] == free["output_ids"]


def test_max_new_tokens_before_the_grammar_ends_is_length(client):
    out = generate(client, {"regex": "[a-z]{50}"}, max_new_tokens=3).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(("constraint", "word"), [
    ({"json_schema": '{"type": "objec"}'}, "objec"),
    ({"json_schema": "{not json"}, "not valid json"),
    ({"json_schema": "[1, 2]"}, "must be a json object"),
    ({"regex": "(a"}, "parenthesis"),
    ({"ebnf": "root ::= undefined_rule"}, "not defined"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}, "structural_tag"),
    ({"regex": "a", "json_schema": "{}"}, "at most one"),
    ({"regex": 5}, "must be a string"),
    ({"regex": ""}, "must not be empty"),
    ({"ebnf": "root ::= root"}, "allows no output"),
    ({"json_schema": '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000}, "nested too deeply"),
    ({"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'}, "needs"),
])
def test_bad_grammars_are_400_with_a_message_and_the_server_stays_healthy(client, server, constraint, word):
    r = generate(client, constraint)
    assert r.status_code == 400, r.text
    assert word.lower() in r.json()["error"]["message"].lower(), r.text
    assert client.get("/health").status_code == 200
    assert_pages_balanced(server.wait_idle())


def test_a_repeated_schema_compiles_once_and_counts_a_cache_hit(client):
    schema = {"type": "object", "properties": {"unique_key_for_this_test": {"type": "boolean"}}, "required": ["unique_key_for_this_test"]}
    compiles, hits = _metric(client, "radixserve_grammar_compiles_total"), _metric(client, "radixserve_grammar_cache_hits_total")
    for _ in range(3):
        assert generate(client, {"json_schema": json.dumps(schema)}).status_code == 200
    assert _metric(client, "radixserve_grammar_compiles_total") == compiles + 1
    assert _metric(client, "radixserve_grammar_cache_hits_total") == hits + 2
    assert _metric(client, "radixserve_grammar_compile_seconds_count") >= compiles + 1


def test_constrained_outputs_survive_retraction_token_for_token(tiny_dir):
    """A pool too small for the batch retracts requests mid-output; each matcher stays with its
    request, so the outputs are the roomy pool's, token for token, and all validate."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 9, "maxItems": 9}
    texts = [f"Numbers {i}: " + "one two three " * (i % 4) for i in range(12)]
    params = [{"max_new_tokens": 60, "temperature": 0.0, **({"json_schema": json.dumps(schema)} if i % 3 else {"ignore_eos": True})}
              for i in range(12)]
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=512) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(texts, params)]
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=40, debug_checks=True) as tight:
        outs = tight.generate(texts, params)
        assert tight.get_stats()["num_retractions_total"] > 0
    assert [o["output_ids"] for o in outs] == expected
    for i, out in enumerate(outs):
        if i % 3:
            jsonschema.validate(json.loads(out["text"]), schema)


def test_a_compile_that_takes_too_long_is_a_400(tiny_dir, tmp_path_factory):
    with running_server(tiny_dir, *TINY_OPTIONS, "--grammar-compile-timeout", "0.001", log_dir=tmp_path_factory.mktemp("logs")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "array", "items": {"type": "string"}} for i in range(40)}}
        r = generate(c, {"json_schema": json.dumps(schema)})
        assert r.status_code == 400 and "did not compile within" in r.json()["error"]["message"], r.text
        assert generate(c, {}).status_code == 200  # and the server goes on serving
        assert_pages_balanced(srv.wait_idle())


# ---------------------------------------------------------------------- pieces


def test_validation_builds_one_grammar_and_refuses_the_rest():
    limits = Limits(max_grammar_chars=64)
    params = parse_sampling_params({"json_schema": {"type": "object"}}, vocab_size=100, limits=limits)
    assert params.grammar == Grammar("json_schema", '{"type": "object"}')
    with pytest.raises(InvalidRequest, match="at most 64"):
        parse_sampling_params({"regex": "a" * 65}, vocab_size=100, limits=limits)
    with pytest.raises(InvalidRequest, match="unknown sampling parameter 'grammar'"):
        parse_sampling_params({"grammar": {"kind": "regex", "text": "a"}}, vocab_size=100, limits=limits)


def _wait(pending: PendingGrammar, timeout: float = 60) -> Any:
    """The compiled grammar (raises GrammarError)."""
    deadline = time.monotonic() + timeout
    while (compiled := pending.compiled()) is None:
        assert time.monotonic() < deadline, "the compile never ended"
        time.sleep(0.01)
    return compiled


# a flat schema that takes minutes of CPU to compile (a few hundred patterned strings), though
# it passes every check before compiling: only killing its compile frees the core
SLOW_SCHEMA = json.dumps({
    "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,40}"} for i in range(300)},
    "required": [f"p{i}" for i in range(300)],
})


def _compile_processes(compiler: GrammarCompiler) -> list[int]:
    """The pids of the compile process and of its forked compiles."""
    zygote = compiler._process._proc
    if zygote is None:
        return []
    children = Path(f"/proc/{zygote.pid}/task/{zygote.pid}/children").read_text().split()
    return [zygote.pid, *map(int, children)]


def test_compiler_shares_one_compile_and_reports_errors(smol):
    compiler = GrammarCompiler(lambda: smol, 49152, [2], timeout=30)
    try:
        first = compiler.compile(Grammar("regex", "[0-9]+"))
        second = compiler.compile(Grammar("regex", "[0-9]+"))
        assert first.job is second.job and compiler.counters.compiles == 1 and compiler.counters.cache_hits == 1
        matcher = compiler.matcher(_wait(first))
        bitmask = compiler.new_bitmask()
        matcher.fill_next_token_bitmask(bitmask)
        digit = smol.convert_tokens_to_ids("7")
        letter = smol.convert_tokens_to_ids("a")
        words = bitmask[0]
        assert (words[digit // 32] >> (digit % 32)) & 1 and not (words[letter // 32] >> (letter % 32)) & 1
        with pytest.raises(GrammarError, match="parenthesis"):
            _wait(compiler.compile(Grammar("regex", "(a")))
        with pytest.raises(GrammarError, match="allows no output"):
            _wait(compiler.compile(Grammar("ebnf", "root ::= root")))
        assert compiler.counters.buckets[-1] == 3  # every compile was timed
    finally:
        compiler.shutdown()


def test_a_compile_past_its_cpu_time_is_killed_and_others_compile_meanwhile(smol):
    """The slow schema's compile is killed at its budget (its process gone, the core free);
    a regex queued behind it is not refused for its wait, nor is a resumed request's grammar
    for its own compile time."""
    compiler = GrammarCompiler(lambda: smol, 49152, [2], timeout=1.0, parallel=1)
    try:
        compiler.warm_up()
        slow = compiler.compile(Grammar("json_schema", SLOW_SCHEMA))
        queued = compiler.compile(Grammar("regex", "[0-9]{3}"))
        deadline = time.monotonic() + 30
        while len(_compile_processes(compiler)) < 2:  # the slow one runs in its own process
            assert time.monotonic() < deadline
            time.sleep(0.01)
        slow_pid = _compile_processes(compiler)[1]
        with pytest.raises(GrammarError, match="did not compile within 1 s"):
            _wait(slow)
        assert not Path(f"/proc/{slow_pid}").exists()  # killed and reaped
        _wait(queued)  # waited behind it for over a second: compiled all the same
        with pytest.raises(GrammarError, match="did not compile within"):  # refused again at once
            _wait(compiler.compile(Grammar("json_schema", SLOW_SCHEMA)), timeout=0.5)
        # over twice the budget alone, but resumed after a restart: never refused for its time
        medium = json.dumps({
            "type": "object", "properties": {f"q{i}": {"type": "string", "pattern": "[a-z]{1,40}"} for i in range(40)},
        })
        started = time.monotonic()
        _wait(compiler.compile(Grammar("json_schema", medium), resumed=True), timeout=120)
        assert time.monotonic() - started > 1.0
    finally:
        compiler.shutdown()


def test_a_compile_nobody_waits_for_is_killed_and_a_full_queue_is_overload(smol):
    compiler = GrammarCompiler(lambda: smol, 49152, [2], timeout=60, parallel=1, max_queued=2)
    try:
        compiler.warm_up()
        slow = compiler.compile(Grammar("json_schema", SLOW_SCHEMA))
        deadline = time.monotonic() + 30
        while len(_compile_processes(compiler)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        compiler.compile(Grammar("regex", "a"))
        compiler.compile(Grammar("regex", "b"))
        with pytest.raises(GrammarBusy, match="2 grammars are waiting"):
            compiler.compile(Grammar("regex", "c"))
        slow_pid = _compile_processes(compiler)[1]
        compiler.give_up(slow)  # its only request went away: its compile is killed
        while Path(f"/proc/{slow_pid}").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _wait(compiler.compile(Grammar("regex", "c")))  # the queue moved on
    finally:
        compiler.shutdown()


def test_a_dead_compile_process_fails_its_compiles_and_a_new_one_starts(smol):
    compiler = GrammarCompiler(lambda: smol, 49152, [2], timeout=60)
    try:
        compiler.warm_up()
        slow = compiler.compile(Grammar("json_schema", SLOW_SCHEMA))
        deadline = time.monotonic() + 30
        while len(processes := _compile_processes(compiler)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(processes[0], signal.SIGKILL)  # the compile process itself (its compiles die with it)
        with pytest.raises(GrammarError, match="its process died"):
            _wait(slow)
        _wait(compiler.compile(Grammar("regex", "[a-c]+")))
        assert _compile_processes(compiler)[0] != processes[0]
    finally:
        compiler.shutdown()


def test_apply_token_bitmasks_keeps_only_allowed_tokens_of_masked_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    allowed = {1, 33, 64, 69}
    words = [0, 0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).numpy().tobytes()
    out = apply_token_bitmasks(logits, [b"", mask, b""])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    finite = {int(i) for i in torch.nonzero(torch.isfinite(out[1])).flatten()}
    assert finite == allowed
    assert torch.equal(out[1][sorted(allowed)], before[1][sorted(allowed)])
