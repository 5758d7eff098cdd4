"""Pinned prefixes (``POST /cache/pin``): documents and system prompts kept on purpose.

A pin is made in two steps. `Scheduler.pin` queues the prefix as a prompt-only request
(``max_new_tokens`` 0: nothing is computed that is cached already); when that request ends,
its pages are in the tree and `Pins.hold` takes them:

- tier "memory": a lock on the prefix's tree node, so eviction never takes its pages;
- tier "disk": its pages are written to the disk tier (those not there yet) and pinned in the
  disk index, so they survive any eviction of memory or disk, and restarts of the server's
  files; in memory they are ordinary cached pages.

Each tier has a budget, ``--max-pinned-fraction`` of the KV pool or of the disk budget, counted
in distinct pages (pins that share a prefix share its pages), so pins can never starve the
running requests. A pin ends at `release` (``/cache/unpin``) or when its ttl runs out.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from radixserve.cache.base import TreeNode
from radixserve.protocol import FinishReason, PinDone, PinInfo, PinPrefix
from radixserve.scheduler.kv import KVManager


class PinRefused(ValueError):
    """The pin cannot be held: its budget is full, or its tier is not there."""


@dataclass
class Pin:
    pin_id: int
    namespace: str | None
    input_ids: list[int]  # the prefix's whole pages' tokens
    tier: str
    created: float
    expires_at: float | None
    node: TreeNode | None = None  # tier "memory": the node it locks
    pages: list[int] = field(default_factory=list)  # tier "memory": the pool pages it holds
    keys: list[bytes] = field(default_factory=list)  # tier "disk": the page keys it holds

    def info(self) -> PinInfo:
        return PinInfo(self.pin_id, self.namespace, len(self.input_ids), self.tier, self.created, self.expires_at)


class Pins:
    def __init__(self, kv: KVManager, max_fraction: float) -> None:
        self.kv = kv
        self.max_fraction = max_fraction
        self._pins: dict[int, Pin] = {}
        self._ids = itertools.count(1)

    def check_order(self, order: PinPrefix) -> None:
        """Refuse, before anything is computed, a pin that could never be held."""
        if order.tier == "disk" and self.kv.disk is None:
            raise PinRefused("tier \"disk\" needs the disk tier: start the server with --kv-disk-dir")
        n_pages = len(order.input_ids) // self.kv.page_size
        if n_pages == 0:
            raise PinRefused(f"the prefix is shorter than one KV page ({self.kv.page_size} tokens): nothing to pin")
        if n_pages > self._budget(order.tier):
            raise PinRefused(
                f"the prefix needs {n_pages} pages, more than the {self._budget(order.tier)} that "
                f"--max-pinned-fraction {self.max_fraction} allows pins in the {order.tier} tier"
            )

    def hold(self, order: PinPrefix, req_keys: list[bytes]) -> Pin:
        """The prefix was just computed (its request ended): pin what the tree holds of it.

        `req_keys`: the prefix's page keys, for the disk tier. Raises `PinRefused`."""
        ns = order.cache_salt or None
        page_size = self.kv.page_size
        aligned = len(order.input_ids) - len(order.input_ids) % page_size
        match = self.kv.cache.match_prefix(order.input_ids[:aligned], ns)
        if match.length == 0:
            raise PinRefused("the prefix was evicted before it could be pinned; try again")
        now = time.time()
        pin = Pin(
            next(self._ids), ns, list(order.input_ids[: match.length]), order.tier, now,
            None if order.ttl is None else now + order.ttl,
        )
        if order.tier == "memory":
            held = self._pages("memory") | set(match.pages)
            if len(held) > self._budget("memory"):
                raise PinRefused(f"the memory tier's pin budget ({self._budget('memory')} pages) is full")
            self.kv.cache.lock(match.node)
            pin.node, pin.pages = match.node, list(match.pages)
        else:
            disk = self.kv.disk
            assert disk is not None  # check_order
            keys = req_keys[: len(match.pages)]
            if len(self._keys() | set(keys)) > self._budget("disk"):
                raise PinRefused(f"the disk tier's pin budget ({self._budget('disk')} pages) is full")
            disk.index.pin(keys)
            for page, key in zip(match.pages, keys, strict=True):
                if key not in disk.index:
                    accepted, evicted = disk.index.add(key)
                    disk.ops.delete += evicted
                    if not accepted:  # cannot happen within the budget; never pin half a prefix
                        disk.index.unpin(keys)
                        raise PinRefused("the disk tier is full of pinned pages")
                    disk.ops.store.append((page, key))
            pin.keys = keys
        self._pins[pin.pin_id] = pin
        return pin

    def complete(self, order: PinPrefix, finish: FinishReason, cached_tokens: int) -> PinDone:
        """The reply to a pin order whose prompt-only request just ended (`finish`): the pin
        held, or why not."""
        if finish.type == "abort":
            return PinDone(order.req_id, error=finish.message or "aborted")
        disk = self.kv.disk
        keys = disk.keys_for(order.input_ids, order.cache_salt or None) if disk is not None else []
        try:
            pin = self.hold(order, keys)
        except PinRefused as exc:
            return PinDone(order.req_id, error=str(exc))
        return PinDone(order.req_id, pin.info(), cached_tokens=cached_tokens)

    def release(self, pin_ids: list[int], input_ids: list[int], namespace: str | None) -> list[Pin]:
        """End the pins named, and those of exactly this prefix in this namespace."""
        aligned = len(input_ids) - len(input_ids) % self.kv.page_size
        ns = namespace or None
        chosen = [
            p for p in self._pins.values()
            if p.pin_id in pin_ids or (aligned and p.namespace == ns and p.input_ids == input_ids[:aligned])
        ]
        for pin in chosen:
            self._drop(pin)
        return chosen

    def expire(self, now: float) -> None:
        for pin in [p for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now]:
            self._drop(pin)

    def list(self) -> list[PinInfo]:
        return [pin.info() for pin in self._pins.values()]

    def pinned_tokens(self, tier: str) -> int:
        held = self._pages(tier) if tier == "memory" else self._keys()
        return len(held) * self.kv.page_size

    def _drop(self, pin: Pin) -> None:
        del self._pins[pin.pin_id]
        if pin.node is not None:
            self.kv.cache.unlock(pin.node)
        if pin.keys and self.kv.disk is not None:
            self.kv.disk.index.unpin(pin.keys)

    def _budget(self, tier: str) -> int:
        if tier == "memory":
            return int(self.max_fraction * self.kv.total_pages)
        return int(self.max_fraction * self.kv.disk.index.capacity) if self.kv.disk is not None else 0

    def _pages(self, tier: str) -> set[int]:
        return {page for p in self._pins.values() if p.tier == tier for page in p.pages}

    def _keys(self) -> set[bytes]:
        return {key for p in self._pins.values() for key in p.keys}
