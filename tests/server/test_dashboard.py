"""The Grafana dashboard (deploy/grafana/radixserve.json) against a real server's /metrics: every
metric it queries exists, every sample carries the served model's name as `model_name`, and
every query selects by it. Where Prometheus is installed (Debian's `prometheus`; `.ci/run`
installs it when it can), a real Prometheus scrapes the server with deploy/prometheus.yml's
settings and runs every query of the dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from http_helpers import HOST, TINY_OPTIONS, Server, free_port, metric_samples

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "radixserve.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
SERVED_NAME = "tiny-dashboard"
SELECTOR = 'model_name=~"$model_name"'
METRIC = re.compile(r"\bradixserve_[a-z0-9_]+")
# label values the test's traffic never produces: no series, so no data for queries selecting them
NEVER_HERE = ('finish_reason="abort"', 'status=~"5.."')


def _queries(node: Any) -> list[str]:
    """Every PromQL `expr` in the dashboard's panels (rows' nested panels included)."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [q for value in node.values() for q in _queries(value)]
    if isinstance(node, list):
        return [q for item in node for q in _queries(item)]
    return []


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tiny_dir: Path) -> Server:
    return start_server(tiny_dir, *TINY_OPTIONS, "--served-model-name", SERVED_NAME)


def _traffic(server: Server) -> None:
    """Requests that finish (so the latency histograms and the finished counter have samples),
    the second one hitting the cache, and one refused."""
    body = {"messages": [{"role": "user", "content": "The same prompt twice, " * 8}], "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/v1/chat/completions", json={**body, "temperature": -1}, timeout=60).status_code == 400


def test_the_dashboard_covers_what_the_issue_lists(dashboard):
    queried = {m for q in _queries(dashboard) for m in METRIC.findall(q)}
    histograms = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds")
    assert {f"radixserve_{h}_bucket" for h in histograms} <= queried
    assert {"radixserve_requests_finished_total", "radixserve_num_running_requests", "radixserve_num_waiting_requests",
            "radixserve_kv_pages_running", "radixserve_kv_pages_cached", "radixserve_kv_pages_free",
            "radixserve_prompt_tokens_total", "radixserve_cached_prompt_tokens_total",
            "radixserve_generation_tokens_total", "radixserve_http_responses_total"} <= queried
    assert any("histogram_quantile(0.99" in q for q in _queries(dashboard))
    hit_rate = [q for q in _queries(dashboard) if "cached_prompt_tokens_total" in q and " / " in q]
    assert hit_rate and "radixserve_prompt_tokens_total" in hit_rate[0].split(" / ")[1]


def test_every_query_selects_by_model_name(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["query"]["query"] == "label_values(radixserve_num_running_requests, model_name)"
    assert variables["model_name"]["multi"] and variables["model_name"]["includeAll"]
    for query in _queries(dashboard):
        for match in METRIC.finditer(query):
            selector = re.match(r"\{([^}]*)\}", query[match.end():])
            assert selector and SELECTOR in selector.group(1), f"{match.group()} without {SELECTOR} in {query}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_the_dashboard_queries_is_on_a_running_server(dashboard, server):
    _traffic(server)
    (model,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert model["id"] == SERVED_NAME
    samples = metric_samples(httpx.get(server.url + "/metrics", timeout=30).text, model_name=SERVED_NAME)
    exposed = {key.split("{")[0] for key in samples}
    queried = {m for q in _queries(dashboard) for m in METRIC.findall(q)}
    assert queried, "no query names a radixserve_ metric"
    assert not queried - exposed, f"the dashboard queries what /metrics does not have: {sorted(queried - exposed)}"


def test_http_answers_are_counted_by_route_and_status(server):
    def counts() -> dict[str, float]:
        return metric_samples(httpx.get(server.url + "/metrics", timeout=30).text, model_name=SERVED_NAME)

    before = counts()
    bad = {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}
    assert httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=30).status_code == 400
    assert httpx.get(server.url + "/v1/models/no-such-model", timeout=30).status_code == 404
    assert httpx.get(server.url + "/no/such/route", timeout=30).status_code == 404
    assert httpx.delete(server.url + "/generate", timeout=30).status_code == 405
    assert httpx.get(server.url + "/", timeout=30).status_code == 200
    after = counts()
    for route, status in (("/v1/chat/completions", 400), ("/v1/models/{model:path}", 404), ("other", 404),
                          ("/generate", 405), ("/", 200)):
        key = f'radixserve_http_responses_total{{route="{route}",status="{status}"}}'
        assert after[key] - before.get(key, 0.0) == 1, key


def _prometheus_config(server: Server) -> dict[str, Any]:
    """deploy/prometheus.yml, scraping the test's server every second."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:30000"]
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"{HOST}:{server.port}"]
    return config


def test_prometheus_runs_every_query_of_the_dashboard(dashboard, server, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no Prometheus: the prometheus binary is not installed (apt-get install prometheus)")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(_prometheus_config(server)))
    port = free_port()
    api = f"http://{HOST}:{port}/api/v1"
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address={HOST}:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it has scraped the server a few times, with traffic between
            _traffic(server)
            try:
                answer = httpx.get(api + "/query", params={"query": "count_over_time(up[1m])"}, timeout=5)
            except httpx.HTTPError:  # not listening yet
                answer = None
            if answer is not None and answer.status_code == 200:  # a 503 "Service Unavailable" while its storage opens
                up = answer.json()
                if up["data"]["result"] and float(up["data"]["result"][0]["value"][1]) >= 4:
                    break
            time.sleep(1)
        else:
            raise AssertionError("Prometheus did not scrape the server:\n" + (tmp_path / "prometheus.log").read_text())
        names = httpx.get(api + "/label/model_name/values", params={"match[]": "radixserve_num_running_requests"}, timeout=10)
        assert names.json()["data"] == [SERVED_NAME]  # what the dashboard's model variable lists
        for query in _queries(dashboard):
            promql = query.replace("$model_name", SERVED_NAME).replace("$__rate_interval", "30s")
            answer = httpx.get(api + "/query", params={"query": promql}, timeout=10).json()
            assert answer["status"] == "success", (query, answer)
            if not any(label in query for label in NEVER_HERE):
                assert answer["data"]["result"], f"no data for {query}"
    finally:
        proc.terminate()
        proc.wait(30)
