"""Tenants from API keys (--api-key-file): every key is let in and a wrong one is not, each
tenant's prefix cache is its own whatever `cache_salt` it sends, the timing of a request tells a
tenant nothing about another's prompts, per-tenant metrics, a bad key file stops the start, and a
flood of pins from one tenant holds up no other (queue limit, per-tenant pin budgets)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_helpers import TINY_OPTIONS, assert_pages_balanced, metric_samples

from radixserve.http.tenants import derived_name, load_api_key_file, namespace

KEY_A = "sk-alpha-0123456789abcdef"
KEY_A2 = "sk-alpha-rotated-fedcba9876"  # a second key of tenant-a
KEY_B = "sk-bravo-0123456789abcdef"
KEY_C = "sk-charlie-unnamed-42"  # no name in the file: gets derived_name(KEY_C)
KEY_OPS = "sk-ops-admin-0123456789"  # an admin key: sees every tenant's numbers
ALL_KEYS = (KEY_A, KEY_A2, KEY_B, KEY_C, KEY_OPS)
KEY_FILE = f"""# tenants of the test server
{KEY_A} tenant-a

{KEY_A2}   tenant-a
  {KEY_B}\ttenant-b
{KEY_C}
{KEY_OPS} ops admin
"""
PROMPT_TOKENS = 600  # long enough that a cached prefill is clearly faster on the tiny model
TRIALS = 80  # B's AUC under no leak has a standard error of 0.046: 0.65 is 3.3 of them


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(start_server, tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    keys = folder / "keys.txt"
    keys.write_text(KEY_FILE)
    # pages for every prompt the timing test caches (4 tokens a page): nothing is evicted
    options = (*TINY_OPTIONS, "--kv-pages", "160000", "--api-key-file", str(keys))
    srv = start_server(tiny_dir, *options)
    yield srv
    log = srv.log()
    assert not any(k in log for k in ALL_KEYS), "a key was logged"


def _generate(server, key: str, *, text: str | None = None, input_ids: list[int] | None = None,
              salt: str | None = None, client: httpx.Client | None = None) -> dict:
    body: dict = {"sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    body.update({"text": text} if text is not None else {"input_ids": input_ids})
    if salt is not None:
        body["cache_salt"] = salt
    r = (client or httpx).post(server.url + "/generate", json=body, headers=_auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _long_text(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i} {tag}" for i in range(100))


def test_every_key_of_the_file_is_let_in_and_no_other(server):
    assert httpx.get(server.url + "/health").status_code == 200
    for key in ALL_KEYS:
        assert httpx.get(server.url + "/v1/models", headers=_auth(key)).status_code == 200, key
    for headers in ({}, _auth("sk-wrong"), _auth(KEY_A + "x"), _auth(KEY_A[:-1]), {"Authorization": KEY_A}):
        r = httpx.post(server.url + "/generate", json={"text": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    info = server.info(**_auth(KEY_OPS))
    assert info["options"]["api_key_file"].endswith("keys.txt") and info["options"]["api_key"] is None
    assert not any(k in str(info) for k in ALL_KEYS)


def test_each_tenant_hits_only_its_own_cache_through_generate(server):
    text = _long_text("generate-isolation")
    assert _generate(server, KEY_A, text=text)["cached_tokens"] == 0
    assert _generate(server, KEY_A, text=text)["cached_tokens"] > 100  # A's own prompt: a hit
    assert _generate(server, KEY_A2, text=text)["cached_tokens"] > 100  # the same tenant's other key
    assert _generate(server, KEY_B, text=text)["cached_tokens"] == 0  # another tenant: cold
    assert _generate(server, KEY_C, text=text)["cached_tokens"] == 0
    assert _generate(server, KEY_B, text=text)["cached_tokens"] > 100  # now cached in B's namespace


def test_each_tenant_hits_only_its_own_cache_through_chat_completions(server):
    messages = [{"role": "user", "content": _long_text("chat-isolation")}]

    def cached(key: str) -> int:
        r = httpx.post(server.url + "/v1/chat/completions", headers=_auth(key), timeout=60,
                       json={"messages": messages, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_B) == 0
    assert cached(KEY_B) > 100
    assert cached(KEY_A) == 0
    assert cached(KEY_C) == 0
    assert cached(KEY_A2) > 100  # tenant-a cached it with KEY_A just above


def test_no_salt_reaches_another_tenants_namespace(server):
    text = _long_text("crafted-salt")
    assert _generate(server, KEY_A, text=text)["cached_tokens"] == 0
    assert _generate(server, KEY_A, text=text)["cached_tokens"] > 100
    # each salt is B's first request in that namespace: any hit would be tenant-a's prefix
    crafted = ["tenant-a", namespace("tenant-a", "x"), "tenant-a\x00", "\x00", "\x00tenant-a", "tenant-b\x00tenant-a",
               KEY_A, "default", " ", "tenant-a ", "../tenant-a", "*"]
    for salt in crafted:
        assert _generate(server, KEY_B, text=text, salt=salt)["cached_tokens"] == 0, repr(salt)
    r = httpx.post(server.url + "/generate", json={"text": text, "cache_salt": ""}, headers=_auth(KEY_B))
    assert r.status_code == 400  # the empty salt is still refused, not read as "no salt"
    # a salt narrows the tenant's own namespace: A with a salt is cold, then hits under that salt only
    assert _generate(server, KEY_A, text=text, salt="narrow")["cached_tokens"] == 0
    assert _generate(server, KEY_A2, text=text, salt="narrow")["cached_tokens"] > 100
    assert _generate(server, KEY_B, text=text, salt="narrow")["cached_tokens"] == 0


def test_per_tenant_metrics_carry_only_the_files_names(server):
    def counters() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=_auth(KEY_OPS)).text
        assert not any(k in text for k in ALL_KEYS)
        return {k: v for k, v in metric_samples(text).items() if k.startswith("radixserve_tenant_") and "_total{" in k}

    before = counters()
    tenants = {"tenant-a", "tenant-b", derived_name(KEY_C), "ops"}
    for metric in ("requests_finished", "prompt_tokens", "cached_prompt_tokens"):
        assert {n for n in before if n.startswith(f"radixserve_tenant_{metric}_total{{")} == {
            f'radixserve_tenant_{metric}_total{{tenant="{t}"}}' for t in tenants
        }
    text = _long_text("metrics")
    first = _generate(server, KEY_A, text=text)
    second = _generate(server, KEY_A2, text=text)
    after = counters()
    key = 'radixserve_tenant_{}_total{{tenant="tenant-a"}}'
    assert after[key.format("requests_finished")] - before[key.format("requests_finished")] == 2
    assert after[key.format("prompt_tokens")] - before[key.format("prompt_tokens")] == first["prompt_tokens"] * 2
    assert after[key.format("cached_prompt_tokens")] - before[key.format("cached_prompt_tokens")] == second["cached_tokens"]
    b = 'radixserve_tenant_requests_finished_total{tenant="tenant-b"}'
    assert after[b] == before[b]


def _auc(slow: list[float], fast: list[float]) -> float:
    """The Mann-Whitney statistic: the chance that a draw of `slow` exceeds one of `fast` (ties
    count half), which is the AUC of the best threshold classifier in that direction."""
    wins = sum((s > f) + 0.5 * (s == f) for s in slow for f in fast)
    return wins / (len(slow) * len(fast))


def test_time_to_first_token_tells_a_tenant_nothing_about_anothers_prompts(server):
    """Interleaved at random (so drift in the host's speed hits every group alike): tenant A
    sends each of TRIALS prompts twice, cold then cached; tenant B sends each of them once, after
    A's first send, and TRIALS cold prompts of the same length. A's hits are plainly faster than
    its misses; B's requests for A's prompts are no faster than its cold ones (B's cache is its
    own, so they are cold too). A one-token request's time is its time to first token."""
    rng = random.Random(18)

    def prompt() -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)]

    a_prompts = [prompt() for _ in range(TRIALS)]
    slots = list(range(4 * TRIALS))
    rng.shuffle(slots)
    order: list[tuple[int, str, list[int]]] = []
    for i, p in enumerate(a_prompts):
        first, *later = sorted(slots[3 * i : 3 * i + 3])  # A's first send precedes B's and A's second
        rng.shuffle(later)
        order += [(first, "a_cold", p), (later[0], "a_hit", p), (later[1], "b_on_a", p)]
    order += [(slot, "b_cold", prompt()) for slot in slots[3 * TRIALS :]]
    order.sort(key=lambda t: t[0])
    times: dict[str, list[float]] = {"a_hit": [], "a_cold": [], "b_on_a": [], "b_cold": []}
    started = time.monotonic()
    with httpx.Client() as client:
        for _, kind, p in order:
            key = KEY_A if kind.startswith("a_") else KEY_B
            t0 = time.perf_counter()
            meta = _generate(server, key, input_ids=p, client=client)
            times[kind].append(time.perf_counter() - t0)
            assert (meta["cached_tokens"] > 0) == (kind == "a_hit"), (kind, meta["cached_tokens"])
    a_auc = _auc(times["a_cold"], times["a_hit"])
    b_auc = _auc(times["b_cold"], times["b_on_a"])
    medians = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    detail = f"A's AUC {a_auc:.3f}, B's AUC {b_auc:.3f}, medians {medians}, {time.monotonic() - started:.1f} s"
    assert a_auc >= 0.9, detail  # the cache works, so the measurement can see a hit
    assert max(b_auc, 1 - b_auc) <= 0.65, detail  # and B cannot tell A's prompts from cold ones


# ---------------------------------------------------------------------- the key file at start-up


@pytest.mark.parametrize(("content", "message"), [
    ("", "no keys"),
    ("# only a comment\n\n   \n", "no keys"),
    ("sk-one a\nsk-two b\nsk-one c\n", "line 3: the same key as on line 1"),
    ("sk-one a\nsk-two b extra\n", "line 2: expected `key` or `key tenant-name`, got 3 fields"),
    ("sk-one a\nsk-two bad/name\n", "line 2: the tenant name must be"),
    ("sk-one -dash\n", "line 1: the tenant name must be"),
    ("sk-one\nsk-two " + derived_name("sk-one") + "\n", "line 2: the tenant name " + derived_name("sk-one")),
])
def test_a_bad_key_file_is_refused_naming_the_line_never_the_key(tmp_path, content, message):
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match="--api-key-file") as info:
        load_api_key_file(path)
    assert message in str(info.value)
    assert "sk-one" not in str(info.value) and "sk-two" not in str(info.value)


def test_the_key_file_format(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# c\n k1  t1 \n\nk2 t1\nk3\n")
    tenants = load_api_key_file(path)
    assert tenants.names == {"t1", derived_name("k3")}
    assert tenants.identify(b"k1").tenant == tenants.identify(b"k2").tenant == "t1"
    assert tenants.identify(b"k3").tenant == derived_name("k3") and derived_name("k3").startswith("tenant-")
    assert tenants.identify(b"k4") is None and tenants.identify(b"") is None and tenants.identify(b"k1 t1") is None
    assert "k3" not in derived_name("k3") and len(derived_name("k3")) == len("tenant-") + 8


def test_the_server_does_not_start_with_a_bad_key_file(tmp_path):
    """Checked before the model loads (the model does not even exist here), exit code 2."""
    def start(*options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "radixserve", "serve", "--model", str(tmp_path / "no-model"), *options],
            capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
        )

    bad = tmp_path / "bad.txt"
    bad.write_text("sk-secret-1 a\nsk-secret-1 b\n")
    out = start("--api-key-file", str(bad))
    assert out.returncode == 2 and "line 2: the same key as on line 1" in out.stderr, out.stderr
    assert "sk-secret-1" not in out.stderr + out.stdout
    out = start("--api-key-file", str(tmp_path / "missing.txt"))
    assert out.returncode == 2 and "cannot read it" in out.stderr, out.stderr
    good = tmp_path / "good.txt"
    good.write_text("sk-secret-2\n")
    out = start("--api-key-file", str(good), "--api-key", "sk-other")
    assert out.returncode == 2 and "not both" in out.stderr and "sk-other" not in out.stderr, out.stderr
    out = start("--api-key-file", str(good), env={"RADIXSERVE_API_KEY": "sk-env"})
    assert out.returncode == 2 and "RADIXSERVE_API_KEY" in out.stderr and "sk-env" not in out.stderr, out.stderr


def test_a_tenants_rids_are_its_own(server):
    """B can reuse a rid that A has in flight, and can abort neither it nor A's other requests;
    A's own other key can."""
    results: dict[str, dict] = {}

    def run(name: str, key: str) -> None:
        body = {"text": "count", "rid": "shared-rid", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        results[name] = httpx.post(server.url + "/generate", json=body, headers=_auth(key), timeout=120).json()

    a = threading.Thread(target=run, args=("a", KEY_A))
    a.start()
    deadline = time.monotonic() + 30
    while server.info(**_auth(KEY_OPS))["requests"]["running"] < 1:
        assert time.monotonic() < deadline, "A's request did not start"
        time.sleep(0.05)
    b = threading.Thread(target=run, args=("b", KEY_B))
    b.start()  # the same rid, another tenant: not a 409
    while server.info(**_auth(KEY_OPS))["requests"]["running"] < 2:
        assert time.monotonic() < deadline and "b" not in results, results.get("b")
        time.sleep(0.05)
    for body in ({"rid": "shared-rid"}, {"abort_all": True}):
        r = httpx.post(server.url + "/abort_request", json=body, headers=_auth(KEY_C))
        assert r.status_code == 200 and r.json() == {"aborted": 0}, (body, r.text)
    r = httpx.post(server.url + "/abort_request", json={"rid": "shared-rid"}, headers=_auth(KEY_A2))
    assert r.json() == {"aborted": 1}  # tenant-a's other key: A's request
    a.join(60)
    assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort", results["a"]
    r = httpx.post(server.url + "/abort_request", json={"abort_all": True}, headers=_auth(KEY_B))
    assert r.json() == {"aborted": 1}
    b.join(60)
    assert results["b"]["meta_info"]["finish_reason"]["type"] == "abort", results["b"]


def _pin(server, key: str, ids: list[int]) -> httpx.Response:
    return httpx.post(server.url + "/cache/pin", json={"input_ids": ids}, headers=_auth(key), timeout=120)


def _document(seed: int, n: int) -> list[int]:
    """Token ids of a document that shares no page with another seed's."""
    start = 1000 + seed * 7919 % 40000
    return [start + i for i in range(n)]


def _refusal(r: httpx.Response) -> None:
    """A refused pin's answer: the documented code, and Retry-After where a retry may succeed."""
    code = {409: "pin_refused", 429: "too_many_pins_in_flight", 503: "overloaded"}[r.status_code]
    assert r.json()["error"]["code"] == code, r.text
    if r.status_code != 409:
        assert r.headers["retry-after"] == "1", r.headers


def test_a_flood_of_pins_neither_fills_the_queue_nor_holds_up_another_tenant(start_server, tiny_dir, tmp_path):
    """Pins count against --max-queued-requests, a tenant has at most
    --max-pins-in-flight-per-tenant (here 2) of them queued or computing and at most
    --max-pinned-share-per-tenant (half) of the pin budget, and every refusal comes before any
    prefill: 40 pins at once from one tenant (over two keys) get 200/409/429 answers while
    another tenant's request completes promptly, and only the pins made were computed."""
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_FILE)
    # pins may hold 2048 pages, one tenant 1024: three 1,200-token documents (300 pages each)
    server = start_server(tiny_dir, "--dtype", "float32", "--page-size", "4", "--kv-pages", "4096",
                          "--chunk-size", "32", "--max-queued-requests", "4", "--max-pins-in-flight-per-tenant", "2",
                          "--api-key-file", str(keys))
    ops = _auth(KEY_OPS)
    before = metric_samples(httpx.get(server.url + "/metrics", headers=ops).text)["radixserve_prompt_tokens_total"]
    with ThreadPoolExecutor(41) as pool:
        pins = [pool.submit(_pin, server, (KEY_A, KEY_A2)[i % 2], _document(i, 1200)) for i in range(40)]
        time.sleep(0.2)  # the burst is in
        start = time.monotonic()
        other = _generate(server, KEY_B, input_ids=[5, 6, 7, 8])
        waited = time.monotonic() - start
        answers = [p.result() for p in pins]
    assert waited < 5, f"tenant-b's 4-token request waited {waited:.1f} s behind tenant-a's pins"
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) <= {200, 409, 429, 503} and 429 in statuses, statuses
    for r in answers:
        if r.status_code != 200:
            _refusal(r)
    made = [r.json() for r in answers if r.status_code == 200]
    assert len(made) <= 3, statuses
    # one pin at a time, tenant-a fills its share: the next is refused at once
    for seed in range(100, 104):
        r = _pin(server, KEY_A, _document(seed, 1200))
        if r.status_code == 409:
            break
        assert r.status_code == 200, r.text
        made.append(r.json())
    assert r.status_code == 409 and "--max-pinned-share-per-tenant" in r.json()["error"]["message"], r.text
    assert len(made) == 3
    r = _pin(server, KEY_B, _document(200, 1200))  # tenant-b's own share is untouched
    assert r.status_code == 200, r.text
    made.append(r.json())
    server.wait_idle(**ops)
    after = metric_samples(httpx.get(server.url + "/metrics", headers=ops).text)["radixserve_prompt_tokens_total"]
    assert after - before == 1200 * len(made) + other["prompt_tokens"], "a refused pin was computed"
    for pin, key in zip(made, [KEY_A] * 3 + [KEY_B], strict=True):
        assert httpx.post(server.url + "/cache/unpin", json={"pin_id": pin["pin_id"]}, headers=_auth(key)).status_code == 200
    assert_pages_balanced(server.wait_idle(**ops))


def test_a_pin_beyond_the_queue_limit_gets_the_503_a_request_gets(start_server, tiny_dir, tmp_path):
    """With the one running slot held by a long generation, four pins (two tenants, two each)
    fill the waiting queue of 4: a fifth pin, like a request, gets 503 overloaded at once; the
    four are made once the slot frees."""
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_FILE)
    server = start_server(tiny_dir, *TINY_OPTIONS, "--max-running-requests", "1", "--max-queued-requests", "4",
                          "--api-key-file", str(keys))
    ops = _auth(KEY_OPS)
    body = {"input_ids": [5, 6, 7, 8], "rid": "holds-the-slot",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    with ThreadPoolExecutor(5) as pool:
        long = pool.submit(httpx.post, server.url + "/generate", json=body, headers=_auth(KEY_C), timeout=120)
        _wait_for_requests(server, {"running": 1, "waiting": 0})
        pins = [pool.submit(_pin, server, key, _document(300 + i, 64)) for i, key in enumerate((KEY_A, KEY_A2, KEY_B, KEY_B))]
        _wait_for_requests(server, {"running": 1, "waiting": 4})
        full = httpx.post(server.url + "/cache/pin", json={"input_ids": _document(310, 64)}, headers=ops, timeout=10)
        assert full.status_code == 503 and "queue is full" in full.json()["error"]["message"], full.text
        _refusal(full)
        r = httpx.post(server.url + "/generate", json={"text": "hi"}, headers=ops, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        r = httpx.post(server.url + "/abort_request", json={"rid": "holds-the-slot"}, headers=_auth(KEY_C))
        assert r.json() == {"aborted": 1}, r.text
        assert long.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        made = [p.result() for p in pins]
    assert [r.status_code for r in made] == [200] * 4, [r.text for r in made]
    for r, key in zip(made, (KEY_A, KEY_A2, KEY_B, KEY_B), strict=True):
        assert httpx.post(server.url + "/cache/unpin", json={"pin_id": r.json()["pin_id"]}, headers=_auth(key)).status_code == 200
    assert_pages_balanced(server.wait_idle(**ops))


def _wait_for_requests(server, requests: dict[str, int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (seen := server.info(**_auth(KEY_OPS))["requests"]) != requests:
        assert time.monotonic() < deadline, f"requests {seen}, waited for {requests}"
        time.sleep(0.05)
