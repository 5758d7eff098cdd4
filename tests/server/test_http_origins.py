"""Browsers against a keyless server (http/origins.py, the Origin/Host middleware, read_json's
content type): a foreign page can neither drive the server with a preflight-free `text/plain`
POST nor flush its cache with a GET, a DNS-rebinding page (a foreign `Host`) can read nothing,
allowed origins get proper CORS, and clients that send no `Origin` (curl, the openai client,
SGLang's router) are unaffected."""

from __future__ import annotations

import json

import httpx
import pytest
from http_helpers import TINY_OPTIONS, running_server
from runtime_helpers import make_tiny_chat_model

from radixserve.__main__ import build_parser, config_from_args
from radixserve.config import ServerConfig

EVIL = "http://evil.example"
APP = "http://app.example:8080"  # allowed by --allowed-origins
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
PLAIN = {"Content-Type": "text/plain"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("origins_model") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """The defaults: no API key, bound to 127.0.0.1, no allowed origins or hosts."""
    with running_server(model, *TINY_OPTIONS, log_dir=tmp_path_factory.mktemp("origins")) as srv:
        yield srv


@pytest.fixture(scope="module")
def cors_server(model, tmp_path_factory):
    options = (*TINY_OPTIONS, "--allowed-origins", f"{APP},https://other.example", "--allowed-origins", "http://third.example",
               "--allowed-hosts", "api.example")
    with running_server(model, *options, log_dir=tmp_path_factory.mktemp("origins_cors")) as srv:
        yield srv


def _post(server, path: str, body: dict, **headers: str) -> httpx.Response:
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=60)


def _error(r: httpx.Response, status: int, says: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body", [
    ("/generate", GEN), ("/abort_request", {"abort_all": True}), ("/cache/pin", {"text": "a document " * 20}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/flush_cache", {}),
])
def test_a_foreign_origin_is_refused_before_anything_runs(server, path, body):
    for content_type in ("text/plain", "application/json"):
        r = _post(server, path, body, Origin=EVIL, **{"Content-Type": content_type})
        _error(r, 403, "not allowed")
        assert "access-control-allow-origin" not in r.headers
    _error(_post(server, path, body, Origin="null"), 403, "not allowed")  # sandboxed frames, file:// pages


def test_a_get_cannot_flush_the_cache(server):
    _error(httpx.get(server.url + "/flush_cache", headers={"Origin": EVIL}), 403, "not allowed")
    _error(httpx.get(server.url + "/flush_cache"), 405, "GET is not allowed")
    assert httpx.post(server.url + "/flush_cache").status_code in (200, 409)  # SGLang's clients POST it


def test_json_routes_need_a_json_content_type(server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = _post(server, "/generate", GEN, **{"Content-Type": content_type})
        _error(r, 415, "Content-Type: application/json")
        assert r.json()["error"]["code"] == "unsupported_media_type"
    for path, body in (("/abort_request", {"abort_all": True}), ("/cache/unpin", {"pin_id": 1})):
        _error(_post(server, path, body, **PLAIN), 415, "application/json")
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, **PLAIN)
    _error(r, 415, "application/json")
    assert _post(server, "/generate", GEN, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    assert _post(server, "/generate", GEN, **{"Content-Type": "Application/JSON"}).status_code == 200


def test_a_foreign_host_is_refused_and_the_servers_own_names_are_not(server):
    """DNS rebinding: the page's requests name the attacker's host."""
    for host in ("evil.example", f"evil.example:{server.port}", f"127.0.0.1:{server.port + 1}", "127.0.0.1.evil.example"):
        r = httpx.get(server.url + "/server_info", headers={"Host": host})
        _error(r, 421, "does not name this server")
        assert "options" not in r.text
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"LOCALHOST:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(server.url + "/server_info", headers={"Host": host}).status_code == 200, host
    _error(httpx.get(server.url + "/health", headers={"Host": "evil.example"}), 421, "--allowed-hosts")
    _error(httpx.get(server.url + "/health", headers={"Host": "api.example"}), 421, "does not name")


def test_allowed_hosts_are_accepted(cors_server):
    for host in ("api.example", f"api.example:{cors_server.port}", f"localhost:{cors_server.port}"):
        assert httpx.get(cors_server.url + "/server_info", headers={"Host": host}).status_code == 200, host
    _error(httpx.get(cors_server.url + "/server_info", headers={"Host": "evil.example"}), 421, "does not name")


def test_clients_without_origin_and_the_servers_own_pages_are_unaffected(server):
    assert httpx.post(server.url + "/generate", json=GEN, timeout=60).status_code == 200
    own = f"http://127.0.0.1:{server.port}"
    r = _post(server, "/generate", GEN, Origin=own)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"http://localhost:{server.port}/generate", json=GEN, headers={"Origin": f"http://localhost:{server.port}"},
                   timeout=60)
    assert r.status_code == 200
    _error(_post(server, "/generate", GEN, Origin=f"http://localhost:{server.port + 1}"), 403, "not allowed")


def test_allowed_origins_get_cors(cors_server):
    server = cors_server
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })
    assert pre.status_code == 204, pre.text
    assert pre.headers["access-control-allow-origin"] == APP
    assert "POST" in pre.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    bad = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
    for origin in (APP, "https://other.example", "http://third.example", "HTTP://APP.EXAMPLE:8080"):
        r = _post(server, "/generate", GEN, Origin=origin)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin and "Origin" in r.headers["vary"]
    r = _post(server, "/generate", GEN, Origin=APP, **PLAIN)  # an allowed origin still sends JSON
    _error(r, 415, "application/json")
    assert r.headers["access-control-allow-origin"] == APP  # so its page can read why
    _error(_post(server, "/generate", GEN, Origin="http://app.example"), 403, "not allowed")  # another port


def test_the_host_rules_by_bound_address():
    # imported here, so that the other tests of this file also run on code without the module
    from radixserve.http.origins import OriginPolicy

    loop = OriginPolicy("127.0.0.1", 30000)
    assert loop.host_ok("127.0.0.1:30000") and loop.host_ok("[::1]:30000") and loop.host_ok("localhost:30000")
    assert not loop.host_ok("10.0.0.5:30000") and loop.host_ok("localhost") and not loop.host_ok("localhost:8080")
    assert not loop.host_ok("evil.example") and not loop.host_ok("[::1")
    anywhere = OriginPolicy("0.0.0.0", 30000)  # no --allowed-hosts: the server cannot know its names
    assert anywhere.host_ok("evil.example") and anywhere.host_ok("api.example:30000")
    named = OriginPolicy("0.0.0.0", 30000, allowed_hosts=("api.example", "proxy.example:443"))
    assert named.host_ok("api.example") and named.host_ok("api.example:8000") and named.host_ok("proxy.example:443")
    assert named.host_ok("10.1.2.3:30000") and named.host_ok("localhost:30000")  # IP literals cannot be rebound
    assert not named.host_ok("evil.example") and not named.host_ok("proxy.example:444")
    one = OriginPolicy("10.0.0.5", 80)
    assert one.host_ok("10.0.0.5") and one.host_ok("10.0.0.5:80") and not one.host_ok("localhost:80")
    assert OriginPolicy("::1", 30000).host_ok("[::1]:30000")
    assert OriginPolicy("127.0.0.1", 30000, allowed_hosts=("*",)).host_ok("whatever")
    star = OriginPolicy("127.0.0.1", 30000, allowed_origins=("*",))
    assert star.cross_origin_allowed("https://any.example") and not loop.cross_origin_allowed("https://any.example")
    assert loop.same_origin("https://api.example", "api.example:443") and not loop.same_origin("null", "api.example")


def test_the_options_parse_repeated_and_comma_separated():
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", "http://A.example:80/, https://b.example:8443",
                              "--allowed-origins", "*", "--allowed-hosts", "api.example,proxy:8080"])
    config = config_from_args(args, parser)
    assert config.allowed_origins == ("http://a.example", "https://b.example:8443", "*")
    assert config.allowed_hosts == ("api.example", "proxy:8080")
    assert ServerConfig(allowed_origins="http://x.example").allowed_origins == ("http://x.example",)
    for bad in ("evil.example", "ftp://x", "http://x/path", "http://user@x"):
        with pytest.raises(ValueError, match="allowed_origins"):
            ServerConfig(allowed_origins=(bad,))
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts=("http://x/",))
