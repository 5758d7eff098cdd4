"""The disk tier (--kv-disk-dir) and pins (/cache/pin) on real servers over HTTP: outputs are the
same whether a prefix was computed, found in memory or read back from disk (fp32 greedy, page
sizes 1 and 16, and transformers' own); a restart serves a hit from disk; a corrupt file is
ignored; tenants never share disk pages or pins; a pinned document survives a flood of other
traffic; and the pages balance throughout."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from http_helpers import Server, metric_samples
from runtime_helpers import hf_greedy

import frontend_lang as fl

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
KEYS = "key-alpha alpha\nkey-beta beta\nkey-ops ops admin\n"
ALPHA = {"Authorization": "Bearer key-alpha"}
OPS = {"Authorization": "Bearer key-ops"}  # an admin key: the global metrics and pages
BETA = {"Authorization": "Bearer key-beta"}
DISK_HITS = 'radixserve_cached_prompt_tokens_total{tier="disk"}'
MEMORY_HITS = 'radixserve_cached_prompt_tokens_total{tier="memory"}'


def doc(seed: int, n: int = 200) -> list[int]:
    """Token ids of a 'document' no other seed shares a page with."""
    start = 1000 + seed * 7919 % 40000  # its own first page: its own branch and key chain
    return [start + i for i in range(n)]


def _options(page_size: int, kv_pages: int, disk: Path, *extra: str) -> tuple[str, ...]:
    return ("--dtype", "float32", "--page-size", str(page_size), "--kv-pages", str(kv_pages), "--chunk-size", "256",
            "--kv-disk-dir", str(disk), "--debug-checks", *extra)


@pytest.fixture(scope="module")
def server(start_server, tiny_dir, tmp_path_factory):
    """Page size 16, a 48-page pool (768 tokens: two documents and a question evict a third),
    tenants from API keys."""
    tmp = tmp_path_factory.mktemp("disk_server")
    keys = tmp / "keys.txt"
    keys.write_text(KEYS)
    disk = tmp / "kv"
    srv = start_server(tiny_dir, *_options(16, 48, disk, "--api-key-file", str(keys)))
    srv.disk = disk
    return srv


def _generate(srv: Server, ids: list[int], headers: dict[str, str], **extra) -> dict:
    r = httpx.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY, **extra},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metrics(srv: Server, headers: dict[str, str]) -> dict[str, float]:
    return metric_samples(httpx.get(srv.url + "/metrics", headers=headers, timeout=30).text)


def _flood(srv: Server, headers: dict[str, str], seeds: range, n: int = 300) -> None:
    for seed in seeds:
        _generate(srv, doc(seed, n), headers)


def _balanced(srv: Server, headers: dict[str, str], pinned_pages: int = 0) -> None:
    pages = srv.wait_idle(**headers)["pages"]
    assert pages["free"] + pages["cached"] == pages["total"], pages
    assert pages["in_use"] == pinned_pages, pages


def test_outputs_are_the_same_computed_from_memory_and_from_disk(server, tiny_dir):
    prompt = doc(1) + [7, 8, 9]
    aligned = (len(prompt) - 1) // 16 * 16
    before = _metrics(server, OPS)
    computed = _generate(server, prompt, ALPHA)
    memory = _generate(server, prompt, ALPHA)
    assert computed["meta_info"]["cached_tokens"] == 0 and memory["meta_info"]["cached_tokens"] == aligned
    _flood(server, ALPHA, range(100, 104))  # 1,200 tokens through a 768-token pool
    disk = _generate(server, prompt, ALPHA)
    after = _metrics(server, OPS)
    assert disk["meta_info"]["cached_tokens"] == aligned
    assert after[DISK_HITS] - before[DISK_HITS] == aligned
    assert computed["output_ids"] == memory["output_ids"] == disk["output_ids"]
    assert computed["output_ids"] == hf_greedy(tiny_dir, [prompt], 8, eos=None)[0]
    assert after["radixserve_kv_disk_pages"] > 0
    assert after["radixserve_kv_disk_stored_bytes_total"] > 0 and after["radixserve_kv_disk_loaded_bytes_total"] > 0
    assert after["radixserve_kv_disk_bytes"] <= after["radixserve_kv_disk_capacity_bytes"]
    _balanced(server, OPS)


def test_tenants_and_salts_never_read_each_others_disk_pages(server):
    prompt = doc(2) + [5]
    _generate(server, prompt, ALPHA)
    _generate(server, prompt, ALPHA, cache_salt="s1")
    _flood(server, BETA, range(200, 204))  # both copies of the document go to disk
    before = _metrics(server, OPS)
    assert _generate(server, prompt, BETA)["meta_info"]["cached_tokens"] == 0  # another tenant
    assert _generate(server, prompt, ALPHA, cache_salt="s2")["meta_info"]["cached_tokens"] == 0  # another salt
    assert _metrics(server, OPS)[DISK_HITS] == before[DISK_HITS]
    assert _generate(server, prompt, ALPHA, cache_salt="s1")["meta_info"]["cached_tokens"] == 192
    assert _metrics(server, OPS)[DISK_HITS] - before[DISK_HITS] == 192
    _balanced(server, OPS)


def test_a_pinned_document_survives_a_flood_that_evicts_everything_else(server):
    document = doc(3, 160)
    r = httpx.post(server.url + "/cache/pin", json={"input_ids": document}, headers=ALPHA, timeout=120)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["tokens"] == 160 and pin["tier"] == "memory" and pin["cached_tokens"] == 0
    other = doc(4) + [1]
    _generate(server, other, ALPHA)
    _flood(server, BETA, range(300, 306))
    before = _metrics(server, OPS)
    assert before['radixserve_pinned_tokens{tier="memory"}'] == 160
    hit = _generate(server, document + [42, 43], ALPHA)
    after = _metrics(server, OPS)
    assert hit["meta_info"]["cached_tokens"] == 160
    assert after[MEMORY_HITS] - before[MEMORY_HITS] == 160 and after[DISK_HITS] == before[DISK_HITS]
    # what was not pinned went to disk and comes back from there
    assert _generate(server, other, ALPHA)["meta_info"]["cached_tokens"] == 192
    assert _metrics(server, OPS)[DISK_HITS] - after[DISK_HITS] == 192
    _balanced(server, OPS, pinned_pages=10)
    # another tenant neither sees nor ends it
    assert httpx.get(server.url + "/cache/pins", headers=BETA).json() == {"pins": []}
    r = httpx.post(server.url + "/cache/unpin", json={"pin_id": pin["pin_id"]}, headers=BETA)
    assert r.status_code == 404
    assert [p["pin_id"] for p in httpx.get(server.url + "/cache/pins", headers=ALPHA).json()["pins"]] == [pin["pin_id"]]
    r = httpx.post(server.url + "/cache/unpin", json={"input_ids": document}, headers=ALPHA)
    assert r.status_code == 200 and [p["pin_id"] for p in r.json()["unpinned"]] == [pin["pin_id"]]
    _balanced(server, OPS)


def test_a_disk_pin_is_written_and_loaded_back_after_the_pool_forgets_it(server):
    document = doc(5, 96)
    r = httpx.post(server.url + "/cache/pin", json={"input_ids": document, "tier": "disk", "cache_salt": "x"},
                   headers=ALPHA, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["tier"] == "disk" and r.json()["cache_salt"] == "x"
    _flood(server, ALPHA, range(400, 404))
    before = _metrics(server, OPS)
    assert before['radixserve_pinned_tokens{tier="disk"}'] == 96
    hit = _generate(server, document + [3], ALPHA, cache_salt="x")
    assert hit["meta_info"]["cached_tokens"] == 96
    assert _metrics(server, OPS)[DISK_HITS] - before[DISK_HITS] == 96
    httpx.post(server.url + "/cache/unpin", json={"pin_id": r.json()["pin_id"]}, headers=ALPHA).raise_for_status()


def test_a_pin_with_a_ttl_ends_by_itself(server):
    r = httpx.post(server.url + "/cache/pin", json={"input_ids": doc(6, 32), "ttl": 0.5}, headers=ALPHA, timeout=120)
    assert r.status_code == 200 and r.json()["expires_at"] is not None
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/cache/pins", headers=ALPHA).json()["pins"]:
        assert time.monotonic() < deadline, "the pin did not expire"
        time.sleep(0.2)
    _balanced(server, OPS)


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"input_ids": doc(7, 32), "tier": "ram"}, 400, "`tier`"),
    ({"input_ids": doc(7, 32), "ttl": -1}, 400, "`ttl`"),
    ({"input_ids": doc(7, 32), "ttl": "soon"}, 400, "`ttl`"),
    ({"input_ids": [1, 2, 3]}, 400, "less than one KV page"),
    ({"input_ids": doc(7, 32), "pinned": True}, 400, "unknown field `pinned`"),
    ({"text": "a", "input_ids": [1]}, 400, "exactly one"),
    ({"input_ids": [[1] * 32]}, 400, "not a list"),
    ({"input_ids": doc(7, 500)}, 409, "--max-pinned-fraction"),
])
def test_bad_pins_get_a_clear_4xx(server, body, status, says):
    r = httpx.post(server.url + "/cache/pin", json=body, headers=ALPHA, timeout=60)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_fl_pin_keeps_a_programs_document(server, tiny_dir):
    backend = fl.RuntimeEndpoint(server.url, api_key="key-alpha")
    text = "The manual says: " + "caching saves time. " * 20 + "\n"
    pin = fl.pin(text, backend=backend)
    assert pin["tokens"] >= 16
    assert [p["pin_id"] for p in httpx.get(server.url + "/cache/pins", headers=ALPHA).json()["pins"]] == [pin["pin_id"]]
    out = backend.generate({"text": text + "Question: what saves time?", "sampling_params": GREEDY})
    assert out["meta_info"]["cached_tokens"] == pin["tokens"]
    assert [p["pin_id"] for p in fl.unpin(pin["pin_id"], backend=backend)] == [pin["pin_id"]]
    backend.close()


def test_a_restart_serves_hits_from_disk_and_a_corrupt_file_is_never_served(tiny_dir, tmp_path):
    """Page size 1: every token is a page (and a file)."""
    disk = tmp_path / "kv"
    options = _options(1, 256, disk)
    prompt = doc(8, 120) + [11]
    first = Server(tiny_dir, *options, log_path=tmp_path / "first.log").wait_healthy()
    try:
        computed = _generate(first, prompt, {})
        _flood(first, {}, range(500, 502), n=150)  # pushes the document to disk
        _balanced(first, {})
    finally:
        assert first.stop() == 0, first.log()
    files = sorted((disk).rglob("*.kv"))
    assert len(files) >= 120

    second = Server(tiny_dir, *options, log_path=tmp_path / "second.log").wait_healthy()
    try:
        restarted = _generate(second, prompt, {})
        metrics = _metrics(second, {})
        assert restarted["meta_info"]["cached_tokens"] == 120
        assert metrics[DISK_HITS] == 120
        assert restarted["output_ids"] == computed["output_ids"]
    finally:
        assert second.stop() == 0, second.log()

    for path in (disk).rglob("*.kv"):  # every page file of the server's directory, one byte each
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x5A
        path.write_bytes(bytes(raw))
    third = Server(tiny_dir, *options, log_path=tmp_path / "third.log").wait_healthy()
    try:
        again = _generate(third, prompt, {})
        metrics = _metrics(third, {})
        assert again["output_ids"] == computed["output_ids"]
        assert again["meta_info"]["cached_tokens"] == 0 and metrics[DISK_HITS] == 0
        assert metrics["radixserve_kv_disk_corrupt_pages_total"] >= 1
        _balanced(third, {})
    finally:
        assert third.stop() == 0, third.log()
    assert "checksum mismatch" in third.log()


def test_the_disk_tier_is_refused_without_the_prefix_cache(tiny_dir, tmp_path):
    srv = Server(tiny_dir, *_options(16, 64, tmp_path / "kv", "--disable-radix-cache"), log_path=tmp_path / "log")
    assert srv.proc.wait(120) != 0
    assert "disable_radix_cache" in srv.log()
