"""A plan: requests over every route drawn by hypothesis, with clients' modes and the kinds of
request dealt in fixed proportions, the same for the same seed."""

from __future__ import annotations

import copy
import random
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from bench.robustness.fuzz.bodies import (
    PIN_EDITS,
    PIN_TEXTS,
    UNPIN_EDITS,
    cap_tokens,
    chat_body,
    completion_body,
    generate_body,
    long_prompt_ids,
    mutate,
    pin_body,
    tools_body,
    unpin_body,
)
from bench.robustness.fuzz.encoding import Pad, Raw, encode
from bench.robustness.fuzz.request import GENERATING, FuzzRequest, Target
from bench.robustness.fuzz.schemas import SCHEMA_KINDS, TOOL_CHOICES, TOOL_EDITS, constrain
from bench.robustness.fuzz.values import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    FOREIGN_HOSTS,
    FOREIGN_ORIGINS,
    GENERATE_KEYS,
    ODD_CONTENT_TYPES,
    RID_FAMILY,
    hostile,
    one_in,
    rids,
    weighted,
)

ADMIN_GETS = ("/health", "/health_generate", "/metrics", "/server_info", "/get_server_info", "/model_info",
              "/get_model_info", "/v1/models", "/flush_cache")
ODD_PATHS = ("/web/", "/generate/", "/v1/chat/completions/", "/v2/generate", "/v1", "/%00", "/..%2fserver_info",
             "/GENERATE", "/generate?x=1", "/v1/completions?stream=true", "/" + "a" * 4000, "/%C2%B2")


# how the clients behave, in these proportions (see FuzzRequest); all but plain ones send to a
# generating route
MODES = {"plain": 860, "leave-stream": 60, "leave": 40, "slow": 15, "chunked": 15, "big": 10}
# what plain clients send, in these proportions; the last five (about a sixth of plain requests)
# are hostile tools, tool choices, schemas and regexes, pins, and requests a browser rule must
# refuse
KINDS = {"/generate": 300, "/v1/completions": 200, "/v1/chat/completions": 200, "admin": 100, "abort": 75,
         "flush": 30, "model-card": 30, "wrong-method": 30, "unknown-route": 35, "long-prompt": 8,
         "tools": 30, "tool_choice": 25, "schema": 50, "pin": 50, "cross-origin": 40}
CROSS_ORIGIN_SHAPES = {"foreign-origin": 35, "foreign-host": 20, "content-type": 30, "get-state-changing": 15}
# the shapes of those five, dealt in these proportions too: each shape is in every plan large
# enough, however hypothesis leans (pins: 55% /cache/pin, 35% /cache/unpin, 10% /cache/pins)
SHAPES = {
    "tools": TOOL_EDITS, "tool_choice": TOOL_CHOICES, "schema": SCHEMA_KINDS, "cross-origin": CROSS_ORIGIN_SHAPES,
    "pin": {**{f"pin-{k}": 11 * w for k, w in PIN_EDITS.items()}, **{f"unpin-{k}": 7 * w for k, w in UNPIN_EDITS.items()},
            "list": 200},
}
# a generating route's valid bodies, and the keys its edits pick from
MAKERS = {"/generate": (generate_body, GENERATE_KEYS), "/v1/completions": (completion_body, COMPLETION_KEYS),
          "/v1/chat/completions": (chat_body, CHAT_KEYS)}


@st.composite
def fuzz_requests(draw: Any, target: Target, mode: str = "plain", kind: str = "/generate",
                  shape: str | None = None) -> FuzzRequest:
    """One request of the plan of a `kind` (a generating route, or one of the others' kinds) whose
    client behaves as `mode` says; for a generating route, a body valid, then maybe mutated, or
    junk; for a kind of `SHAPES`, a request of that `shape`. Tags name the hostile shapes it
    carries (and the kind of `SHAPES` it is of), for the figures and for the CI test's check
    that a plan covers them."""
    tags: list[str] = [kind] if kind in SHAPES else []
    cap = target.leaver_tokens if mode.startswith("leave") else target.max_new_tokens
    if kind in GENERATING:
        path = kind
        maker, keys = MAKERS[path]
        body = maker(draw, target, tags, cap)
        if mode == "leave-stream":
            body["stream"] = True
        junk = one_in(draw, 20)
        body = _junk_body(draw, tags) if junk else mutate(draw, target, tags, body, keys)
        streams = isinstance(body, dict) and body.get("stream") is True
        leaves = mode == "leave" or (mode == "leave-stream" and streams)  # a client that stays reads it all
        cap_tokens(body, target, cap if leaves else target.max_new_tokens, path)
        req = FuzzRequest("POST", path, path, body)
    elif kind == "long-prompt":  # dealt, besides the ones drawn, so that every plan holds some
        body = {"input_ids": long_prompt_ids(draw, target, tags),
                "sampling_params": {"max_new_tokens": draw(st.integers(1, 4)), "temperature": 0}}
        cap_tokens(body, target, target.max_new_tokens, "/generate")
        req = FuzzRequest("POST", "/generate", "/generate", body)
    elif kind in ("tools", "tool_choice", "schema"):  # hostile as drawn: not mutated further
        path = "/v1/chat/completions" if kind != "schema" else draw(st.sampled_from(GENERATING))
        if kind == "tools":
            body = tools_body(draw, target, tags, cap, shape, weighted(draw, TOOL_CHOICES))
        elif kind == "tool_choice":
            body = tools_body(draw, target, tags, cap, "valid", shape)
        else:
            body = MAKERS[path][0](draw, target, tags, cap)
            constrain(draw, path, body, tags, shape)
        cap_tokens(body, target, target.max_new_tokens, path)
        req = FuzzRequest("POST", path, path, body)
    else:
        req = _other_request(draw, target, tags, kind, shape)
    req.mode = mode
    req.ascii_only = not one_in(draw, 4)
    if not req.ascii_only:
        tags.append("utf8-body")
    if mode == "leave-stream":
        req.leave_after = draw(st.integers(0, 2))
    elif mode == "leave":
        req.leave_after = draw(st.sampled_from((0, 10, 100, 500)))
    elif mode == "slow":
        req.pieces = draw(st.integers(2, 6))
    elif mode == "big":
        limit = target.max_body_bytes
        size = draw(st.sampled_from((limit - 1, limit, limit + 1, 2 * limit)))
        _add_pad(draw, target, req, size, tags)
    if one_in(draw, 20):
        req.content_type = draw(st.sampled_from((*ODD_CONTENT_TYPES, "application/json; charset=latin-1")))
        tags.append("odd-content-type")
    if one_in(draw, 50):
        req.headers["Authorization"] = draw(st.sampled_from(("Bearer x", "Bearer", "Basic Zm9v", "")))
    tags.append(f"mode-{mode}")
    req.tags = tuple(dict.fromkeys(tags))
    return req


JUNK = (
    b"", b" ", b"{", b'{"text": "hi"', b"[1, 2]", b"null", b'"x"', b"\xef\xbb\xbf{}", b'{"text": "\xff"}',
    b"[" * 5000 + b"]" * 5000, b'{"text": "a", "text": 5}', b"{}" + b"\x00", b'{"a":NaN}',
)


def _junk_body(draw: Any, tags: list[str]) -> Any:
    tags.append("junk-body")
    return draw(st.one_of(
        st.binary(max_size=64),
        st.sampled_from(JUNK),
        hostile(),
    ))


def _other_request(draw: Any, target: Target, tags: list[str], kind: str, shape: str | None) -> FuzzRequest:
    if kind == "admin":
        path = draw(st.sampled_from(ADMIN_GETS))
        req = FuzzRequest("GET", path, path)
        if one_in(draw, 10):
            req.body = draw(_junk_body_bytes())
        return req
    if kind == "flush":
        path = draw(st.sampled_from(("/flush_cache", "/reset_prefix_cache")))
        return FuzzRequest("POST", path, path, draw(st.one_of(st.none(), _junk_body_bytes())))
    if kind == "abort":
        tags.append("abort")
        shape = weighted(draw, {"rid": 60, "all": 5, "hostile": 35})
        body: Any = {"abort_all": True} if shape == "all" else {"rid": draw(rids())}
        if body.get("rid") in RID_FAMILY:
            tags.append("rid-family")
        if shape == "hostile":
            body = draw(st.one_of(st.fixed_dictionaries({"abort_all": hostile()}),
                                  st.fixed_dictionaries({"rid": hostile()}), hostile()))
        return FuzzRequest("POST", "/abort_request", "/abort_request", body)
    if kind == "model-card":
        names = (target.model_name, "", "gpt-4", "a" * 300, "x/y", "..", "\u00b2")
        model = draw(st.one_of(st.sampled_from(names), st.text(max_size=8)))
        return FuzzRequest("GET", "/v1/models/" + quote(model, safe="/"), "/v1/models/{id}")
    if kind == "wrong-method":
        tags.append("wrong-method")
        path = draw(st.sampled_from((*GENERATING, *ADMIN_GETS, "/abort_request", "/reset_prefix_cache")))
        method = draw(st.sampled_from(("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST")))
        right = {"POST"} if path in (*GENERATING, "/abort_request", "/reset_prefix_cache") else {"GET", "HEAD"}
        if method in right or path == "/flush_cache" and method == "POST":
            method = "PUT"
        return FuzzRequest(method, path, "(wrong method)", draw(st.one_of(st.none(), hostile())))
    if kind == "pin":
        if shape == "list":
            return FuzzRequest("GET", "/cache/pins", "/cache/pins")
        route, _, edit = shape.partition("-")
        make = pin_body if route == "pin" else unpin_body
        return FuzzRequest("POST", f"/cache/{route}", f"/cache/{route}", make(draw, target, tags, edit))
    if kind == "cross-origin":
        return _cross_origin_request(draw, tags, shape)
    tags.append("unknown-route")
    return FuzzRequest(draw(st.sampled_from(("GET", "POST"))), draw(st.sampled_from(ODD_PATHS)), "(unknown)")


# a cheap valid request for each route a foreign page would aim at: what must not run
BROWSER_TARGETS = {
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 1}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
    "/abort_request": {"abort_all": True},
    "/flush_cache": None,
    "/reset_prefix_cache": None,
    "/cache/pin": {"text": PIN_TEXTS[0]},
    "/cache/unpin": {"pin_id": 1},
    "/server_info": None,
}


def _cross_origin_request(draw: Any, tags: list[str], shape: str) -> FuzzRequest:
    """What a foreign web page can make a browser send: a request with its foreign Origin (often
    a `text/plain` body, which needs no preflight), one of a DNS-rebinding page (a foreign Host),
    a JSON route's body not declared JSON, or a GET on a route that changes state (an image
    tag). Each must be refused with its 4xx (`oracle.must_refuse_request`), never run."""
    if shape != "content-type":  # tagged by the type below
        tags.append(shape)
    if shape == "get-state-changing":
        path = draw(st.sampled_from(sorted(p for p in BROWSER_TARGETS if p != "/server_info")))
        query = draw(st.sampled_from(("", "?abort_all=true", "?text=hi")))
        return FuzzRequest(draw(st.sampled_from(("GET", "HEAD"))), path + query, "(wrong method)")
    paths = [p for p, body in BROWSER_TARGETS.items() if body is not None or shape != "content-type"]
    path = draw(st.sampled_from(paths))
    body = copy.deepcopy(BROWSER_TARGETS[path])
    req = FuzzRequest("GET" if path == "/server_info" else "POST", path, path, body)
    if body is not None and (shape == "content-type" or one_in(draw, 2)):
        req.content_type = None if one_in(draw, 3) else draw(st.sampled_from(ODD_CONTENT_TYPES))
        tags.append("no-content-type" if req.content_type is None else "odd-content-type")
    if shape == "foreign-origin":
        req.headers["Origin"] = draw(st.sampled_from(FOREIGN_ORIGINS))
    elif shape == "foreign-host":
        req.headers["Host"] = host = draw(st.sampled_from(FOREIGN_HOSTS))
        if draw(st.booleans()):  # a rebinding page is same-origin with its own name
            req.headers["Origin"] = f"http://{host}"
    return req


def _junk_body_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=32), st.just(b"{}"), st.just(b'{"rid": "x"}'))


def _add_pad(draw: Any, target: Target, req: FuzzRequest, size: int, tags: list[str]) -> None:
    """Make the body `size` bytes: filler in the prompt (at most 1 MB of it: tokenizing more
    would measure the tokenizer), in an extra field, or as whitespace."""
    tags.append("big-body")
    where = draw(st.sampled_from(("field", "space", "text")))
    if not isinstance(req.body, dict):
        generate = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        req.body = generate if req.path == "/generate" else {"prompt": "hi", "max_tokens": 1}
    if where == "text":
        size = min(size, 1_000_000)
        if req.path == "/v1/chat/completions":
            req.body["messages"] = [{"role": "user", "content": Pad(size)}]
        else:
            req.body.pop("input_ids", None)
            req.body["prompt" if req.path == "/v1/completions" else "text"] = Pad(size)
    elif where == "field":
        req.body["padding"] = Pad(size)
    else:
        text = encode(req.body).decode()
        req.body = Raw(text + " " * max(0, size - len(text)))
    if size > target.max_body_bytes:
        tags.append("over-limit")


def draw_plan(target: Target, count: int, seed: int = 0) -> list[FuzzRequest]:
    """`count` requests drawn by hypothesis from `fuzz_requests`, the same ones for the same
    seed, hypothesis version and program (`python -m bench.robustness.fuzz` always draws the same plan;
    another process that has imported other modules may draw another one). Clients' modes and plain clients' kinds of request are dealt
    in the proportions of `MODES` and `KINDS` (at least one of each in a plan of 100 or more), the
    hostile classes' shapes in those of `SHAPES`, and shuffled: hypothesis leans towards some choices, which would leave the rare ones out."""
    plan = []
    for mode, n in _deal(count, MODES).items():
        kinds = _deal(n, KINDS) if mode == "plain" else _deal(n, dict.fromkeys(GENERATING, 1))
        for kind, k in kinds.items():
            for shape, j in (_deal(k, SHAPES[kind]) if kind in SHAPES else {None: k}).items():
                plan += _draw(fuzz_requests(target, mode, kind, shape), j, seed)
    rng = random.Random(seed)
    rng.shuffle(plan)
    _race_rids(plan, rng)
    return plan


def _race_rids(plan: list[FuzzRequest], rng: random.Random) -> None:
    """Put a request carrying a rid of the `x` family (or an abort of one) right after each `x`
    with n=2, so that two clients race on the ids its samples once had."""
    racers = [i for i, r in enumerate(plan) if "rid-family" in r.tags]
    for i, req in enumerate(plan[:-1]):
        if "rid-x#1-with-n2" in req.tags and racers:
            j = rng.choice(racers)
            if j > i + 1:
                plan[i + 1], plan[j] = plan[j], plan[i + 1]


def _deal(count: int, weights: dict[str, int]) -> dict[str, int]:
    """`count` split in proportion to `weights` (each at least 1 when count allows); the rest to the first."""
    total, least = sum(weights.values()), int(count >= 100 or count >= 4 * len(weights))
    counts = {k: max(count * w // total, least) for k, w in weights.items()}
    first = next(iter(weights))
    counts[first] += count - sum(counts.values())
    return {k: n for k, n in counts.items() if n > 0}


def _draw(strategy: st.SearchStrategy[FuzzRequest], count: int, seed: int) -> list[FuzzRequest]:
    out: list[FuzzRequest] = []
    while len(out) < count:

        @settings(max_examples=count - len(out), database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @hypothesis_seed(seed + len(out))
        @given(strategy)
        def collect(req: FuzzRequest) -> None:
            out.append(req)

        before = len(out)
        collect()
        if len(out) == before:
            raise RuntimeError("hypothesis drew no request")
    return out[:count]
