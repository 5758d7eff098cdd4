"""--kv-cache-dtype on a real server and Engine: what the server reports, the pool's tokens at
the same memory, a disk tier round trip of int8 pages (output and accounting), and
speculation giving plain decoding's greedy output over a quantized KV cache."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import assert_pages_balanced, metric_samples

from radixserve import Engine
from tests.server.test_speculative import PROMPTS, SPEC, echo_dir  # noqa: F401 - a fixture

MEMORY = "0.004"  # GiB: a small pool, the same bytes for every dtype


@pytest.fixture(scope="module")
def servers(start_server, tiny_dir):
    return {name: start_server(tiny_dir, "--dtype", "float32", "--kv-memory-gb", MEMORY, "--kv-cache-dtype", name)
            for name in ("float32", "int8")}


def _info(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=30).json()


def test_the_server_reports_its_kv_dtype_and_pool_tokens(servers):
    fp32, int8 = _info(servers["float32"]), _info(servers["int8"])
    assert fp32["model"]["kv_cache_dtype"] == "float32" and int8["model"]["kv_cache_dtype"] == "int8"
    assert int8["pages"]["tokens"] == int8["model"]["kv_pool_tokens"] == int8["pages"]["total"] * int8["model"]["page_size"]
    # fp32 -> int8 with an fp16 scale per token and head: 4 * D bytes against D + 2 (D = 16 here)
    assert int8["pages"]["tokens"] >= 3.5 * fp32["pages"]["tokens"]
    metrics = metric_samples(httpx.get(servers["int8"].url + "/metrics", timeout=30).text)
    (key,) = [k for k in metrics if k.startswith("radixserve_kv_pool_tokens")]
    assert 'kv_cache_dtype="int8"' in key and metrics[key] == int8["pages"]["tokens"]


def test_an_int8_server_serves_caches_and_balances(servers):
    url = servers["int8"].url
    prompt = "The river flows north to the sea, past the mill and the old stone bridge. " * 8
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    first = httpx.post(url + "/generate", json=body, timeout=120).json()
    again = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == first["output_ids"]
    assert len(first["output_ids"]) == 12
    assert_pages_balanced(_info(servers["int8"]))


def test_int8_pages_spilled_to_disk_come_back_with_the_same_output(start_server, tiny_dir, tmp_path):
    srv = start_server(tiny_dir, "--dtype", "float32", "--kv-cache-dtype", "int8", "--kv-pages", "24",
                       "--page-size", "4", "--kv-disk-dir", str(tmp_path / "kv"))
    doc = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 3

    def ask(text: str) -> dict:
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
        return httpx.post(srv.url + "/generate", json=body, timeout=120).json()

    first = ask(doc + "Question one?")
    for i in range(6):  # other prompts push the document out of the 24-page pool, to disk
        ask(f"Unrelated text number {i}: " + "lorem ipsum dolor sit amet " * 6)
    back = ask(doc + "Question one?")
    metrics = metric_samples(httpx.get(srv.url + "/metrics", timeout=30).text)
    assert back["output_ids"] == first["output_ids"]
    assert metrics['radixserve_cached_prompt_tokens_total{tier="disk"}'] > 0
    assert_pages_balanced(_info(srv))


@pytest.mark.parametrize("name,page_size", [("int8", 16), ("fp8_e4m3", 1), ("fp8_e5m2", 16)])
def test_speculation_gives_plain_greedy_output_over_a_quantized_kv_cache(echo_dir, name, page_size):  # noqa: F811
    params = [{"temperature": 0, "max_new_tokens": 40}]
    outputs = {}
    for spec in (False, True):
        options = {"kv_cache_dtype": name, "page_size": page_size, **(SPEC if spec else {})}
        with Engine(model=str(echo_dir), dtype="float32", **options) as engine:
            outputs[spec] = engine.generate(PROMPTS, [params[0]] * len(PROMPTS))
    accepted = 0
    for plain, spec in zip(outputs[False], outputs[True], strict=True):
        assert spec["output_ids"] == plain["output_ids"]
        accepted += spec["meta_info"].get("spec_accepted_tokens", 0)
    assert accepted > 0  # drafts were really checked and kept
