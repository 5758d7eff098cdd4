"""/cache/pin and /cache/unpin tokenize a `text` prefix in the prepare threads, as /generate
does, never on the event loop (where six 320k-character texts once pushed /health's p50 to
2.4 s): checked with the real routes on a state whose tokenizer and manager record their thread."""

from __future__ import annotations

import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.testclient import TestClient

from radixserve.front.validation.limits import Limits
from radixserve.http import cache_api
from radixserve.http.state import ServerState
from radixserve.protocol import PinDone, PinInfo, PinList, WorkerInfo


class _Tokenizer:
    """Whitespace 'tokens'; remembers the threads it ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, text: str):
        self.threads.append(threading.current_thread().name)
        return types.SimpleNamespace(input_ids=[1 + len(w) % 50 for w in text.split()])


class _Manager:
    def __init__(self) -> None:
        self.threads: list[str] = []

    async def pin(self, ids, ns, tier, ttl, tenant=None):
        self.threads.append(threading.current_thread().name)
        return PinDone(0, PinInfo(1, ns, len(ids), tier, time.time()))

    async def unpin(self, pin_ids, ids, ns):
        self.threads.append(threading.current_thread().name)
        return PinList(0, [PinInfo(1, ns, len(ids), "memory", time.time())])

    async def pins(self):
        return PinList(0, [])


def _app() -> tuple[Starlette, types.SimpleNamespace]:
    state = types.SimpleNamespace(
        config=types.SimpleNamespace(kv_disk_dir=None, max_body_bytes=1 << 20),
        tokenizer=_Tokenizer(), limits=Limits(),
        ready=WorkerInfo(100, 4, 4096, 100, [0], "m", "float32", "cpu", "generic"),
        prepare_pool=ThreadPoolExecutor(1, thread_name_prefix="radixserve-prepare"), manager=_Manager(),
    )
    state.prepare = types.MethodType(ServerState.prepare, state)
    state.get_manager = lambda: state.manager
    app = Starlette(routes=cache_api.routes())
    app.state.server = state
    return app, state


def test_pin_and_unpin_tokenize_text_off_the_event_loop():
    app, state = _app()
    text = "a shared system prompt " * 20
    with TestClient(app) as client:
        r = client.post("/cache/pin", json={"text": text, "ttl": 60})
        assert r.status_code == 200 and r.json()["tokens"] == 80, r.text
        r = client.post("/cache/unpin", json={"text": text})
        assert r.status_code == 200 and len(r.json()["unpinned"]) == 1, r.text
    loop_threads = set(state.manager.threads)
    assert len(state.tokenizer.threads) == 2 and len(loop_threads) == 1
    assert all(t.startswith("radixserve-prepare") for t in state.tokenizer.threads), state.tokenizer.threads
    assert not loop_threads & set(state.tokenizer.threads)
    state.prepare_pool.shutdown()


def test_pin_errors_from_the_prepare_thread_are_still_400s():
    app, state = _app()
    with TestClient(app) as client:
        r = client.post("/cache/pin", json={"text": "too short"})
        assert r.status_code == 400 and "less than one KV page" in r.json()["error"]["message"]
        r = client.post("/cache/pin", json={"text": "a b c d e", "ttl": 10**400})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"
    state.prepare_pool.shutdown()
