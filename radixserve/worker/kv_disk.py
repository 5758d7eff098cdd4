"""The disk tier's files: KV pages written back on eviction, read ahead, loaded into the pool.

The scheduler decides (cache/disk_index.py owns what is on disk, and which page goes first);
this module only does what a `ForwardBatch.disk` says, in the worker, around the forward:

    1. store: copy the evicted pages out of the pool now (their ids may be reused by this very
       step), and write them to disk on the writer thread;
    2. load: copy pages read ahead earlier into the pool pages the scheduler gave them;
    3. read ahead / drop / delete: queue reads (reader thread) and deletes (writer thread).

Reads and writes never block the step. The scheduler learns what finished from the next
`ForwardResult.disk` (`DiskReport`): which reads are ready to load, which failed, which writes
were lost.

One file per page, `<dir>/<model key>/<page key>.kv`, written to a temp file and renamed, so a
file is whole or absent; a torn or corrupt one (size, header or CRC-32 of the payload wrong)
is deleted with a warning when found, never loaded:

    magic "RSKV" | version u32 | model key (32) | page key (32) | payload bytes u64 | crc32 u32
    payload: [num_layers, 2 (K, V), page_size, num_kv_heads, head_dim] in the pool's dtype

A lock file keeps a second server off the same directory (its budget and deletes would fight
this one's). The directory holds tenants' KV, so it must be private: one this server creates is
made 0700; an existing one must belong to this user and give nobody else any access (else the
start fails, saying so: the server never changes the mode of a directory it did not create, such
as a shared 1777 /tmp). Anything in it that is not a regular file (a directory, a FIFO, a
symlink, a socket named like a page) is never opened: it is skipped with a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import stat as stat_module
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixserve.attention.kv_pool import KVPool, raw
from radixserve.protocol import DiskOps, DiskReport

log = logging.getLogger("radixserve.worker")

_MAGIC = b"RSKV"
_VERSION = 1
_HEADER = struct.Struct("<4sI32s32sQI")
_SUFFIX = ".kv"
_TEMP_SUFFIX = ".tmp"


def model_key(weight_files: list[Path], pool: KVPool, weight_format: str = "none") -> bytes:
    """SHA-256 over the weights' content and everything that shapes a page's bytes: two
    servers share disk pages only if the same model wrote them the same way (the same weights
    held quantized compute other K/V than dequantized: `weight_format`, models/loader.py)."""
    digest = hashlib.sha256(b"radixserve-kv-model\x00")
    for path in sorted(weight_files):
        digest.update(path.name.encode() + b"\x00")
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    layout = (
        f"v{_VERSION} dtype={pool.dtype} page_size={pool.page_size} layers={pool.num_layers} "
        f"kv_heads={pool.num_kv_heads} head_dim={pool.head_dim} layout=LKV-NHD"
    )
    if pool.converted:  # pages of different KV dtypes never mix (a pool of the model's dtype: as before)
        layout += f" kv_cache_dtype={pool.format.name}{' scales=LKV-fp16' if pool.format.scaled else ''}"
    if weight_format != "none":  # dequantized weights: as before
        layout += f" weights={weight_format}"
    digest.update(layout.encode())
    return digest.digest()


@dataclass
class _Counters:
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    corrupt: int = 0


@dataclass
class _Outcomes:
    """What the threads finished since the last report (guarded by DiskStore._lock)."""

    ready: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)


class DiskStore:
    """The worker's half of the disk tier: files under one directory, two I/O threads."""

    def __init__(self, root: str | Path, pool: KVPool, key: bytes) -> None:
        self.pool = pool
        self.key = key
        root = Path(root).expanduser()
        _make_private_dir(root)
        self.dir = root / key.hex()[:32]
        _make_private_dir(self.dir)
        self._lock_file = self._take_lock(root)
        # a page on disk is the bytes of each of the pool's page tensors for it, in
        # `KVPool.page_tensors` order (K, V per layer, then int8's scales)
        self._tensors = pool.page_tensors()
        self._tensor_bytes = [t[0].numel() * t.element_size() for t in self._tensors]
        self.payload_bytes = sum(self._tensor_bytes)
        self.file_bytes = _HEADER.size + self.payload_bytes
        # host copies by page key: written back and not yet on disk, or read ahead and not
        # yet loaded; a read of a page still being written takes its copy from here
        self._writing: dict[bytes, torch.Tensor] = {}
        self._staged: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._outcomes = _Outcomes()
        self.counters = _Counters()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ start-up

    def _take_lock(self, root: Path):
        lock = (root / ".lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"--kv-disk-dir {root} is in use by another radixserve server") from None
        return lock

    def scan(self) -> list[bytes]:
        """The page keys on disk, least recently used first. Leftover temp files (a write cut
        short) and files whose size or header is wrong are deleted with a warning."""
        found: list[tuple[float, bytes]] = []
        for path in self.dir.iterdir():
            if not path.name.endswith((_TEMP_SUFFIX, _SUFFIX)):
                continue
            try:
                regular = stat_module.S_ISREG(path.lstat().st_mode)
            except FileNotFoundError:
                continue
            if not regular:
                log.warning("kv disk: skipping %s: not a regular file (left as it is, never read)", path.name)
                continue
            if path.name.endswith(_TEMP_SUFFIX):
                path.unlink(missing_ok=True)
                continue
            try:
                page_key = bytes.fromhex(path.name[: -len(_SUFFIX)])
                header, stat = _read_regular(path, _HEADER.size)
                self._check_header(header, page_key, stat.st_size)
            except NotRegularFile as exc:  # replaced since the lstat above
                log.warning("kv disk: skipping %s: %s", path.name, exc)
                continue
            except (ValueError, OSError) as exc:
                log.warning("kv disk: dropping %s: %s", path.name, exc)
                self.counters.corrupt += 1
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, page_key))
        found.sort()
        return [page_key for _, page_key in found]

    def _check_header(self, header: bytes, page_key: bytes, size: int) -> int:
        """Raise ValueError unless the header is this model's and this page's; the payload CRC."""
        if len(header) != _HEADER.size:
            raise ValueError("header cut short")
        magic, version, model, page, payload, crc = _HEADER.unpack(header)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError("not a radixserve KV page file of this version")
        if model != self.key:
            raise ValueError("written by another model or KV layout")
        if page != page_key:
            raise ValueError("its header names another page")
        if payload != self.payload_bytes or size != _HEADER.size + payload:
            raise ValueError(f"{size} bytes, expected {self.file_bytes}")
        return crc

    def close(self) -> None:
        """Write what is queued, then stop the writer (the reader's work no longer matters)."""
        self._writes.put(None)
        self._threads[0].join()

    # ------------------------------------------------------------------ the step's operations

    def apply(self, ops: DiskOps) -> None:
        """Before the forward: copy out, copy in, queue the rest (see the module docstring)."""
        if ops.store:
            self._store(ops.store)
        if ops.load:
            self._load(ops.load)
        with self._lock:
            for page_key in ops.unstage:
                self._staged.pop(page_key, None)
        for page_key in ops.prefetch:
            self._reads.put(page_key)
        for page_key in ops.delete:
            self._writes.put((page_key, None))

    def report(self) -> DiskReport:
        with self._lock:
            out, self._outcomes = self._outcomes, _Outcomes()
        c = self.counters
        return DiskReport(
            ready=out.ready, failed=out.failed, lost=out.lost, stored_bytes=c.stored_bytes,
            loaded_bytes=c.loaded_bytes, store_seconds=c.store_seconds, load_seconds=c.load_seconds,
            corrupt_pages=c.corrupt,
        )

    def _store(self, store: list[tuple[int, bytes]]) -> None:
        pages = torch.tensor([page for page, _ in store], dtype=torch.long, device=self.pool.device)
        # [n, payload_bytes] on the host: one gather per page tensor
        parts = [raw(t).index_select(0, pages).reshape(len(store), -1).view(torch.uint8) for t in self._tensors]
        host = torch.cat(parts, dim=1).to("cpu")
        with self._lock:
            for i, (_, page_key) in enumerate(store):
                self._writing[page_key] = host[i]
        for _, page_key in store:
            self._writes.put((page_key, True))

    def _load(self, load: list[tuple[int, bytes]]) -> None:
        start = time.perf_counter()
        with self._lock:
            host = [self._staged.pop(page_key) for _, page_key in load]
        data = torch.stack(host).to(self.pool.device)  # [n, payload_bytes]
        pages = torch.tensor([page for page, _ in load], dtype=torch.long, device=self.pool.device)
        at = 0
        for tensor, nbytes in zip(self._tensors, self._tensor_bytes, strict=True):
            part = data[:, at : at + nbytes].contiguous().view(raw(tensor).dtype)
            raw(tensor).index_copy_(0, pages, part.view(len(load), *tensor.shape[1:]))
            at += nbytes
        self.counters.loaded_bytes += len(load) * self.payload_bytes
        self.counters.load_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ the I/O threads

    def _path(self, page_key: bytes) -> Path:
        return self.dir / (page_key.hex() + _SUFFIX)

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            page_key, write = job
            if write is None:
                self._path(page_key).unlink(missing_ok=True)
                continue
            with self._lock:
                tensor = self._writing.get(page_key)
            if tensor is None:
                continue
            start = time.perf_counter()
            try:
                self._write(page_key, tensor)
            except OSError as exc:
                log.warning("kv disk: could not write a page (%s); it is dropped from the tier", exc)
                with self._lock:
                    self._outcomes.lost.append(page_key)
            else:
                self.counters.stored_bytes += self.payload_bytes
                self.counters.store_seconds += time.perf_counter() - start
            with self._lock:
                if self._writing.get(page_key) is tensor:
                    del self._writing[page_key]

    def _write(self, page_key: bytes, tensor: torch.Tensor) -> None:
        payload = _as_bytes(tensor)
        header = _HEADER.pack(_MAGIC, _VERSION, self.key, page_key, len(payload), zlib.crc32(payload))
        path = self._path(page_key)
        temp = path.with_name(path.name + f".{threading.get_ident()}{_TEMP_SUFFIX}")
        try:
            with temp.open("wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, path)  # whole or absent, never half written
        except OSError:
            temp.unlink(missing_ok=True)
            raise

    def _read_loop(self) -> None:
        while True:
            page_key = self._reads.get()
            with self._lock:
                tensor = self._writing.get(page_key)
            if tensor is None:
                tensor = self._read(page_key)
            with self._lock:
                if tensor is None:
                    self._outcomes.failed.append(page_key)
                else:
                    self._staged[page_key] = tensor
                    self._outcomes.ready.append(page_key)

    def _read(self, page_key: bytes) -> torch.Tensor | None:
        path = self._path(page_key)
        try:
            raw, _ = _read_regular(path)
            crc = self._check_header(raw[: _HEADER.size], page_key, len(raw))
            payload = memoryview(raw)[_HEADER.size :]
            if zlib.crc32(payload) != crc:
                raise ValueError("payload checksum mismatch")
            os.utime(path)  # its age on disk is its LRU time at the next start
        except FileNotFoundError:
            log.warning("kv disk: page file %s is gone; it is computed again", path.name)
            return None
        except NotRegularFile as exc:
            log.warning("kv disk: skipping %s: %s; it is computed again", path.name, exc)
            return None
        except (ValueError, OSError) as exc:
            log.warning("kv disk: dropping %s: %s; it is computed again", path.name, exc)
            self.counters.corrupt += 1
            path.unlink(missing_ok=True)
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _make_private_dir(path: Path) -> None:
    """Create `path` 0700, or check that the existing one is this user's and private."""
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # whatever the umask
        return
    except FileExistsError:
        pass
    info = path.stat()
    if not stat_module.S_ISDIR(info.st_mode):
        raise RuntimeError(f"--kv-disk-dir: {path} exists and is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(
            f"--kv-disk-dir: {path} is not private (mode {stat_module.S_IMODE(info.st_mode):04o}, owner uid "
            f"{info.st_uid}): it would hold tenants' KV where others can reach it. Give a directory of "
            "your own with mode 0700 (chmod 700 it), or a path that does not exist yet (created 0700)"
        )


class NotRegularFile(OSError):
    """A page's name on something other than a regular file: never read, never deleted."""


def _read_regular(path: Path, limit: int = -1) -> tuple[bytes, os.stat_result]:
    """Up to `limit` bytes (all: -1) of a regular file, and its stat; OSError for anything else.
    Opened without blocking and without following a symlink, so a FIFO or a device named like
    a page can neither hang nor redirect the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat_module.S_ISREG(info.st_mode):
            raise NotRegularFile("not a regular file (left as it is, never read)")
        return f.read(limit), info


def _as_bytes(tensor: torch.Tensor) -> bytes:
    """Raw bytes of a host tensor of bytes (a page: `DiskStore._store`)."""
    return tensor.contiguous().numpy().tobytes()
