"""The fuzzer's hostile classes (bench/robustness/fuzz/): the strategies make what they claim (a
deep schema is as deep as it says, a foreign request is one the browser rules refuse), the
oracle's rules for tools, schemas, pins and browsers say refuse exactly where the documented
rules do, and the stream probe's figures add up. No server: tests/server/test_fuzz_http.py runs
the plan against one."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from bench.robustness.fuzz import FuzzRequest, Target, must_refuse, must_refuse_request
from bench.robustness.fuzz.encoding import json_or_none
from bench.robustness.fuzz.plan import SHAPES, fuzz_requests
from bench.robustness.fuzz.probe import StreamTimes, phase_figures, probe_figures, worst_gap
from bench.robustness.fuzz.schemas import SCHEMA_SHAPES, json_depth, nested_regex, nested_schema

TARGET = Target(model_name="tiny", vocab_size=49152, context_len=2048, max_body_bytes=200_000)
FEW = settings(max_examples=15, database=None, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("shape", SCHEMA_SHAPES)
@pytest.mark.parametrize("depth", [2, 3, 50, 64, 65, 251, 500])
def test_a_nested_schema_is_exactly_as_deep_as_asked(shape, depth):
    schema = nested_schema(depth, shape)
    assert json_depth(schema) == depth
    json.loads(json.dumps(schema))  # plain JSON, not too deep for the encoder


def test_nested_shapes_are_what_they_say():
    assert "properties" not in json.dumps(nested_schema(20, "array"))
    assert '"items"' not in json.dumps(nested_schema(20, "object"))
    mixed = json.dumps(nested_schema(20, "mixed"))
    assert '"items"' in mixed and '"properties"' in mixed
    with pytest.raises(ValueError):
        nested_schema(1, "object")


def test_json_depth_counts_containers_only():
    assert json_depth(5) == 0 and json_depth({}) == 1 and json_depth([[], {"a": [1]}]) == 3


@pytest.mark.parametrize("shape", ["groups", "alternation", "stars"])
def test_a_nested_regex_has_its_depth_in_groups(shape):
    assert nested_regex(300, shape).count("(") == 300


def _constraint(req: FuzzRequest):
    """The schema or regex a request of the "schema" kind carries."""
    body = req.body
    if req.path == "/generate":
        sp = body["sampling_params"]
        sp = sp[0] if isinstance(sp, list) else sp
        value = sp.get("json_schema", sp.get("regex"))
    else:
        fmt = body.get("response_format")
        value = fmt["json_schema"]["schema"] if fmt else next(
            body[k] for k in ("json_schema", "guided_json", "regex", "guided_regex") if k in body)
    return json.loads(value) if isinstance(value, str) and value.startswith("{") else value


@FEW
@given(fuzz_requests(TARGET, "plain", "schema", "deep"))
def test_deep_schema_requests_carry_a_deep_schema(req):
    assert "schema" in req.tags and any(t.startswith("schema-deep-") for t in req.tags)
    assert json_depth(_constraint(req)) >= 50


@FEW
@given(fuzz_requests(TARGET, "plain", "schema", "regex-deep"))
def test_deep_regex_requests_carry_a_deep_regex(req):
    assert _constraint(req).count("(") >= 50


@FEW
@given(fuzz_requests(TARGET, "plain", "tools", "deep"))
def test_deep_tool_requests_carry_deep_parameters(req):
    assert req.path == "/v1/chat/completions" and "tools-deep" in req.tags
    assert max(json_depth(t["function"]["parameters"]) for t in req.body["tools"]) >= 64


@pytest.mark.parametrize("shape", [s for s in SHAPES["schema"] if s not in ("local-ref", "regex-deep")])
def test_every_hostile_schema_but_a_recursive_one_breaks_a_rule(shape):
    @FEW
    @given(fuzz_requests(TARGET, "plain", "schema", shape))
    def check(req):
        body = json_or_none(req.payload())  # None: more digits than Python parses, which the server refuses too
        if body is not None and (shape != "deep" or json_depth(_constraint(req)) > 64):
            assert must_refuse(req.path, body, TARGET) is not None, req.describe()

    check()


@pytest.mark.parametrize("shape", ["foreign-origin", "foreign-host", "get-state-changing"])
def test_cross_origin_requests_are_ones_the_rules_refuse(shape):
    status = {"foreign-origin": 403, "foreign-host": 421, "get-state-changing": 405}[shape]

    @FEW
    @given(fuzz_requests(TARGET, "plain", "cross-origin", shape))
    def check(req):
        assert {"cross-origin", shape} <= set(req.tags)
        assert must_refuse_request(req, TARGET)[0] == status, req.describe()

    check()


def _tool(name="f", parameters=None):
    fn = {"name": name, "parameters": {"type": "object"} if parameters is None else parameters}
    return {"type": "function", "function": fn}


@pytest.mark.parametrize("tools, choice", [
    ([_tool(), _tool()], None),  # duplicate names
    ([_tool(name=5)], "auto"),
    ([_tool(name="a b")], None),
    ([_tool(parameters="object")], None),
    ([_tool(parameters=nested_schema(65, "array"))], "none"),  # too deep, whatever the choice
    ([{"function": {"name": "f"}}], None),  # no type
    ([_tool()] * 129, None),
    ({"type": "function"}, None),
    ([_tool()], {"type": "function", "function": {"name": ["f"]}}),
    ([_tool()], {"type": "function", "function": {"name": {"name": "f"}}}),
    ([_tool()], {"type": "function", "function": {"name": 0}}),
    ([_tool()], {"type": "function", "function": {}}),
    ([_tool()], {"type": "function", "function": {"name": "g"}}),
    ([_tool()], {"function": {}}),
    ([_tool()], "AUTO"),
    (None, "required"),
    ([_tool(parameters={"type": "object", "properties": {"a": {"not": {}}}})], "required"),
    ([_tool(parameters={"$ref": "http://evil.example/s.json"})], {"type": "function", "function": {"name": "f"}}),
])
def test_the_tool_rules_refuse(tools, choice):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
    assert must_refuse("/v1/chat/completions", body, TARGET) is not None


@pytest.mark.parametrize("tools, choice", [
    ([_tool("f"), _tool("g")], "required"),
    ([_tool()], {"type": "function", "function": {"name": "f"}}),
    ([_tool(parameters=nested_schema(64, "mixed"))], "auto"),
    ([_tool(parameters={"not": {}})], "auto"),  # shown to the model, not compiled: allowed
    ([], "none"),
    (None, "auto"),
])
def test_the_tool_rules_let_valid_tools_through(tools, choice):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
    assert must_refuse("/v1/chat/completions", body, TARGET) is None


@pytest.mark.parametrize("route, body", [
    ("/cache/pin", {"text": "x", "ttl": 10**400}),
    ("/cache/pin", {"text": "x", "ttl": float("inf")}),
    ("/cache/pin", {"text": "x", "ttl": -1}),
    ("/cache/pin", {"text": "x", "ttl": "60"}),
    ("/cache/pin", {"text": "x", "ttl": True}),
    ("/cache/pin", {"text": "x", "tier": "gpu"}),
    ("/cache/pin", {"text": "x", "tier": "disk"}),  # no disk tier on TARGET
    ("/cache/pin", {"text": "x", "tier": None}),
    ("/cache/pin", {"text": "x", "input_ids": [1]}),
    ("/cache/pin", {"text": "x", "pin_id": 1}),
    ("/cache/unpin", {"pin_id": 1, "text": "x"}),
    ("/cache/unpin", {"pin_id": "1"}),
    ("/cache/unpin", {"pin_id": True}),
    ("/cache/unpin", {}),
    ("/cache/unpin", {"text": "x", "ttl": 5}),
])
def test_the_pin_rules_refuse(route, body):
    assert must_refuse(route, body, TARGET) is not None


@pytest.mark.parametrize("route, body", [
    ("/cache/pin", {"text": "x", "ttl": 1e308, "tier": "memory"}),
    ("/cache/pin", {"input_ids": [1, 2], "ttl": 5e-324, "cache_salt": "a"}),
    ("/cache/unpin", {"pin_id": 10**400}),  # an integer: no such pin is a 404, not a rule
    ("/cache/unpin", {"input_ids": [1]}),
])
def test_the_pin_rules_let_valid_bodies_through(route, body):
    assert must_refuse(route, body, TARGET) is None


@pytest.mark.parametrize("schema", [nested_schema(65, "object"), {"not": {}}, {"$ref": "file:///etc/passwd"},
                                    {"allOf": [{"type": "string"}, {"type": "integer"}]}])
def test_the_schema_rules_refuse_on_every_route(schema):
    gen = {"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}}
    assert must_refuse("/generate", gen, TARGET) is not None
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert must_refuse("/v1/completions", {"prompt": "hi", "response_format": fmt}, TARGET) is not None
    assert must_refuse("/v1/chat/completions", {"messages": [], "guided_json": schema}, TARGET) is not None


def test_local_references_and_the_depth_limit_are_allowed():
    for schema in ({"$defs": {"n": {"items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}, nested_schema(64, "object")):
        assert must_refuse("/generate", {"text": "hi", "sampling_params": {"json_schema": schema}}, TARGET) is None


def _request(method="POST", path="/generate", body=None, content_type="application/json", **headers):
    req = FuzzRequest(method, path, path, {"text": "hi"} if body is None else body, headers=headers)
    req.content_type = content_type
    return req


def test_the_browser_rules_in_their_order():
    assert must_refuse_request(_request(), TARGET) is None
    assert must_refuse_request(_request(Host="evil.example:80", Origin="http://evil.example"), TARGET)[0] == 421
    assert must_refuse_request(_request(Origin="null", content_type="text/plain"), TARGET)[0] == 403
    assert must_refuse_request(_request("GET", "/flush_cache?x=1", Origin="http://127.0.0.1.evil.example"), TARGET)[0] == 403
    assert must_refuse_request(_request("GET", "/flush_cache"), TARGET)[0] == 405
    assert must_refuse_request(_request("HEAD", "/cache/pin"), TARGET)[0] == 405
    assert must_refuse_request(_request(content_type="text/plain"), TARGET)[0] == 415
    assert must_refuse_request(_request(content_type=None), TARGET)[0] == 415
    assert must_refuse_request(_request(content_type="APPLICATION/JSON; charset=utf-8"), TARGET) is None
    assert must_refuse_request(_request("GET", "/server_info", content_type="text/plain"), TARGET) is None
    big = _request(body={"text": "a" * TARGET.max_body_bytes}, content_type="text/plain")
    assert must_refuse_request(big, TARGET) is None  # 413 comes first
    opened = Target(**{**TARGET.__dict__, "browser_rules": False})  # --allowed-origins, --allowed-hosts
    assert must_refuse_request(_request(Origin="http://evil.example", Host="evil.example"), opened) is None


def test_probe_figures():
    idle = [StreamTimes.timed(0.0, [0.0, 0.01, 0.02], "ok"), StreamTimes.timed(5.0, [5.0, 5.004, 5.03], "ok")]
    during = [StreamTimes.timed(10.0, [10.0, 10.01, 10.11, 10.12], "aborted"), StreamTimes((), "overloaded")]
    assert idle[1].worst_at == 5.004 and worst_gap(during) == pytest.approx((10.01, 10.11))
    figures = probe_figures(idle, during)
    assert figures["idle"]["worst_gap_ms"] == 26.0 and figures["during"]["worst_gap_ms"] == 100.0
    assert figures["during"]["ends"] == {"aborted": 1, "overloaded": 1} and figures["during"]["gaps"] == 3
    assert figures["worst_gap_ratio"] == pytest.approx(100 / 26, abs=0.01)
    assert phase_figures([])["worst_gap_ms"] is None and probe_figures([], during)["worst_gap_ratio"] is None
