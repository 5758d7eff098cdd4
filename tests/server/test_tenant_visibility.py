"""What a tenant's key sees of the server (--api-key-file): its own tenant's metrics only, and a
/server_info without the key file's path, page or queue counts; an admin key (`KEY NAME admin`
in the file) sees everything, as every client does without tenants."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import TINY_OPTIONS, metric_samples, running_server
from runtime_helpers import make_tiny_chat_model

from radixserve.http.tenants import load_api_key_file

KEY_A = "sk-visibility-alpha-0123"
KEY_B = "sk-visibility-bravo-4567"
KEY_OPS = "sk-visibility-ops-89ab"
KEY_FILE = f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n{KEY_OPS} ops admin\n"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("visibility")
    model = make_tiny_chat_model(folder / "model")
    keys = folder / "keys.txt"
    keys.write_text(KEY_FILE)
    with running_server(model, *TINY_OPTIONS, "--api-key-file", str(keys), log_dir=folder) as srv:
        srv.keys = keys
        yield srv


def _metrics(server, key: str) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers=_auth(key))
    assert r.status_code == 200, r.text
    return metric_samples(r.text)


def test_a_tenant_sees_only_its_own_metrics_and_an_admin_sees_all(server):
    body = {"text": "a document " * 30, "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(server.url + "/generate", json=body, headers=_auth(KEY_A), timeout=60).status_code == 200
    assert httpx.post(server.url + "/cache/pin", json={"text": "pinned by a " * 20}, headers=_auth(KEY_A),
                      timeout=60).status_code == 200
    seen_by_b = _metrics(server, KEY_B)
    assert seen_by_b, "tenant-b sees nothing at all"
    assert all('tenant="tenant-b"' in name for name in seen_by_b), sorted(seen_by_b)
    assert not any("pinned" in name or "tenant-a" in name for name in seen_by_b)
    assert seen_by_b['radixserve_tenant_requests_finished_total{tenant="tenant-b"}'] == 0
    seen_by_a = _metrics(server, KEY_A)
    assert seen_by_a['radixserve_tenant_requests_finished_total{tenant="tenant-a"}'] >= 1
    assert not any("tenant-b" in name for name in seen_by_a)
    seen_by_ops = _metrics(server, KEY_OPS)
    assert seen_by_ops['radixserve_tenant_requests_finished_total{tenant="tenant-a"}'] >= 1
    assert 'radixserve_tenant_requests_finished_total{tenant="tenant-b"}' in seen_by_ops
    assert seen_by_ops['radixserve_pinned_tokens{tier="memory"}'] > 0


def test_a_tenants_server_info_hides_the_key_file_and_the_global_numbers(server):
    info = server.info(**_auth(KEY_B))
    text = str(info)
    assert str(server.keys) not in text and "keys.txt" not in text
    for global_part in ("pages", "requests", "pids", "engine", "placement"):
        assert global_part not in info, global_part
    assert info["model"]["context_len"] > 0 and info["tenant"] == "tenant-b"
    assert info["options"]["api_key_file"] == "***"
    ops = server.info(**_auth(KEY_OPS))
    assert ops["options"]["api_key_file"] == str(server.keys)
    assert ops["pages"]["total"] > 0 and ops["requests"] == {"running": 0, "waiting": 0}


def test_the_admin_field_of_the_key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("k1 t1\nk2 t1 admin\nk3\n")
    tenants = load_api_key_file(path)
    assert tenants.identify(b"k1").tenant == tenants.identify(b"k2").tenant == "t1"  # the admin key is still t1's
    assert not tenants.identify(b"k1").admin and tenants.identify(b"k2").admin and not tenants.identify(b"k3").admin
    path.write_text("k1 t1 root\n")
    with pytest.raises(ValueError, match="line 1: expected"):
        load_api_key_file(path)
