"""The disk tier's directory against hostile contents (worker/kv_disk.py): a directory or a FIFO
named like a page file is skipped at start-up (it crashed the worker, or hung it), and a shared
directory (mode 1777) is refused with a clear message instead of having its mode changed."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import httpx
import pytest
import torch
from http_helpers import TINY_OPTIONS, Server
from runtime_helpers import make_tiny_chat_model

from radixserve.attention.kv_pool import KVPool
from radixserve.protocol import DiskOps
from radixserve.worker.kv_disk import DiskStore

MODEL = hashlib.sha256(b"hostile-model").digest()
PAGE_NAME = "ab" * 32 + ".kv"  # 64 hex digits: a page file's name


def _pool() -> KVPool:
    return KVPool(num_layers=2, num_pages=8, page_size=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def _scan_in_thread(store: DiskStore, timeout: float = 10.0) -> list[bytes]:
    """`store.scan()`, failing the test (instead of hanging it) if it does not return."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["found"] = store.scan()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "scan() hung on the directory's contents"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["found"]  # type: ignore[return-value]


def test_a_directory_a_fifo_and_a_symlink_named_like_pages_are_skipped(tmp_path, caplog):
    root = tmp_path / "kv"
    store = DiskStore(root, _pool(), MODEL)
    good = bytes([7]) * 32
    store.apply(DiskOps(store=[(1, good)]))
    store.close()
    store._lock_file.close()
    (store.dir / PAGE_NAME).mkdir()
    os.mkfifo(store.dir / ("cd" * 32 + ".kv"))
    (store.dir / ("ef" * 32 + ".kv")).symlink_to("/etc/passwd")
    (store.dir / ("01" * 32 + ".kv.1.tmp")).mkdir()  # a leftover temp name on a directory too
    again = DiskStore(root, _pool(), MODEL)
    try:
        assert _scan_in_thread(again) == [good]
    finally:
        again.close()
    assert (store.dir / PAGE_NAME).is_dir() and stat.S_ISFIFO((store.dir / ("cd" * 32 + ".kv")).lstat().st_mode)
    assert "not a regular file" in caplog.text
    assert Path("/etc/passwd").exists()


def test_a_shared_directory_is_refused_and_its_mode_left_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(RuntimeError, match=r"not private \(mode 1777"):
        DiskStore(shared, _pool(), MODEL)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    fresh = tmp_path / "new" / "kv"
    store = DiskStore(fresh, _pool(), MODEL)  # created by the server: 0700
    store.close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700 and stat.S_IMODE(store.dir.stat().st_mode) == 0o700


def test_a_server_starts_despite_a_directory_and_a_fifo_named_like_pages(tmp_path):
    """The real worker at start-up: a directory named like a page killed it (IsADirectoryError,
    exit 1), a FIFO hung it. Both are skipped; the server serves."""
    model = make_tiny_chat_model(tmp_path / "model")
    disk = tmp_path / "kv"
    options = (*TINY_OPTIONS, "--kv-disk-dir", str(disk))
    first = Server(model, *options, log_path=tmp_path / "first.log").wait_healthy()
    assert first.stop() == 0, first.log()
    (model_dir,) = [p for p in disk.iterdir() if p.is_dir()]
    (model_dir / PAGE_NAME).mkdir()
    os.mkfifo(model_dir / ("cd" * 32 + ".kv"))
    second = Server(model, *options, log_path=tmp_path / "second.log")
    try:
        second.wait_healthy(timeout=90)
        r = httpx.post(second.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        assert second.stop() == 0, second.log()
    assert "not a regular file" in second.log()


def test_a_server_on_a_shared_directory_fails_with_a_clear_message(tmp_path):
    model = make_tiny_chat_model(tmp_path / "model")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    srv = Server(model, *TINY_OPTIONS, "--kv-disk-dir", str(shared), log_path=tmp_path / "log")
    try:
        code = srv.proc.wait(120)
    finally:
        srv.stop()  # a server that started anyway is stopped, not left behind
    assert code != 0
    assert "is not private (mode 1777" in srv.log(), srv.log()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
