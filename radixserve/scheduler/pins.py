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
running requests; with tenants (``--api-key-file``) each tenant's pins may hold at most
``--max-pinned-share-per-tenant`` of it. A pin order reserves the pages it may add while it is
queued and computed, so an order that could not be held is refused before any prefill
(`take_order`), and a tenant has at most ``--max-pins-in-flight-per-tenant`` orders in flight:
a flood of pins neither fills the waiting queue nor holds up other tenants' requests.
A pin ends at `release` (``/cache/unpin``) or when its ttl runs out.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from radixserve.cache.base import TreeNode
from radixserve.protocol import FinishReason, PinDone, PinInfo, PinPrefix
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.policy import common_prefix_len
from radixserve.scheduler.segments import segment_owner


class PinRefused(ValueError):
    """The pin cannot be held: its budget is full, or its tier is not there."""

    refusal = "refused"  # PinDone.refusal


class PinsInFlight(PinRefused):
    """The tenant already has its bound of pin orders queued or computing: it may order again
    once one is answered."""

    refusal = "pins_in_flight"


@dataclass
class _Order:
    """A pin being made (its prefix queued or computing) and the pages it reserves: those of its
    tier the pin may add to the pages held or reserved already."""

    tenant: str | None
    namespace: str | None
    tier: str
    input_ids: list[int]  # the prefix's whole pages' tokens
    pages: int


@dataclass
class Pin:
    pin_id: int
    tenant: str | None
    namespace: str | None
    input_ids: list[int]  # the prefix's whole pages' tokens
    tier: str
    created: float
    expires_at: float | None
    node: TreeNode | None = None  # tier "memory": the node it locks
    pages: list[int] = field(default_factory=list)  # tier "memory": the pool pages it holds
    keys: list[bytes] = field(default_factory=list)  # tier "disk": the page keys it holds

    def info(self) -> PinInfo:
        namespace, segment = segment_owner(self.namespace)
        return PinInfo(self.pin_id, namespace, len(self.input_ids), self.tier, self.created, self.expires_at, segment)


class Pins:
    def __init__(self, kv: KVManager, max_fraction: float, tenant_share: float, max_in_flight: int) -> None:
        self.kv = kv
        self.max_fraction = max_fraction
        self.tenant_share = tenant_share  # of a tier's budget, for each tenant but None
        self.max_in_flight = max_in_flight  # orders per tenant, None included
        self._pins: dict[int, Pin] = {}
        self._orders: dict[int, _Order] = {}  # by PinPrefix.req_id, until `complete`
        self._ids = itertools.count(1)

    def take_order(self, order: PinPrefix) -> None:
        """Accept a pin order, reserving the pages it may add, or refuse it before anything is
        computed: one that could never be held, one beyond its tenant's bound of orders in flight
        (`PinsInFlight`), and one that would not fit with the pins held and being made."""
        if order.tier == "disk" and self.kv.disk is None:
            raise PinRefused("tier \"disk\" needs the disk tier: start the server with --kv-disk-dir")
        page_size = self.kv.page_size
        n_pages = len(order.input_ids) // page_size
        if n_pages == 0:
            raise PinRefused(f"the prefix is shorter than one KV page ({page_size} tokens): nothing to pin")
        budget = self._budget(order.tier)
        if n_pages > budget:
            raise PinRefused(
                f"the prefix needs {n_pages} pages, more than the {budget} that "
                f"--max-pinned-fraction {self.max_fraction} allows pins in the {order.tier} tier"
            )
        tenant = order.tenant
        if tenant is not None and n_pages > self._tenant_budget(order.tier):
            raise PinRefused(
                f"the prefix needs {n_pages} pages, more than the {self._tenant_budget(order.tier)} that "
                f"--max-pinned-share-per-tenant {self.tenant_share} allows one tenant's pins in the {order.tier} tier"
            )
        in_flight = sum(o.tenant == tenant for o in self._orders.values())
        if in_flight >= self.max_in_flight:
            who = "this tenant" if tenant is not None else "the server's clients (one tenant without --api-key-file)"
            raise PinsInFlight(
                f"{in_flight} pins of {who} are being made, the most --max-pins-in-flight-per-tenant allows; "
                "pin again once one is answered"
            )
        ns = order.cache_salt or None
        ids = list(order.input_ids[: n_pages * page_size])
        # pages shared with a pin held or being made in the same namespace and tier are counted once
        prefixes = [p.input_ids for p in self._pins.values() if p.namespace == ns and p.tier == order.tier]
        prefixes += [o.input_ids for o in self._orders.values() if o.namespace == ns and o.tier == order.tier]
        new = n_pages - max((common_prefix_len(ids, other) // page_size for other in prefixes), default=0)
        held, reserved = len(self._held(order.tier)), self._reserved(order.tier)
        if held + reserved + new > budget:
            raise PinRefused(
                f"the {order.tier} tier's pin budget is full: pins hold {held} of its {budget} pages "
                f"(--max-pinned-fraction {self.max_fraction}) and pins being made may take {reserved} "
                f"more; this prefix needs {new}"
            )
        if tenant is not None:
            held, reserved = len(self._held(order.tier, tenant)), self._reserved(order.tier, tenant)
            if held + reserved + new > self._tenant_budget(order.tier):
                raise PinRefused(
                    f"this tenant's share of the {order.tier} tier's pin budget is full: its pins hold "
                    f"{held} of its {self._tenant_budget(order.tier)} pages (--max-pinned-share-per-tenant "
                    f"{self.tenant_share}) and its pins being made may take {reserved} more; this prefix needs {new}"
                )
        self._orders[order.req_id] = _Order(tenant, ns, order.tier, ids, new)

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
            next(self._ids), order.tenant, ns, list(order.input_ids[: match.length]), order.tier, now,
            None if order.ttl is None else now + order.ttl,
        )
        if order.tier == "memory":
            self._check_hold("memory", order.tenant, set(match.pages))
            self.kv.cache.lock(match.node)
            pin.node, pin.pages = match.node, list(match.pages)
        else:
            disk = self.kv.disk
            assert disk is not None  # take_order
            keys = req_keys[: len(match.pages)]
            self._check_hold("disk", order.tenant, set(keys))
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
        self._orders.pop(order.req_id, None)  # answered: no longer in flight, its pages no longer reserved
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
        return len(self._held(tier)) * self.kv.page_size

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

    def _tenant_budget(self, tier: str) -> int:
        return int(self.tenant_share * self._budget(tier))

    def _check_hold(self, tier: str, tenant: str | None, pages: set[int] | set[bytes]) -> None:
        """Refuse to hold `pages` (the tier's pool pages or disk keys) beyond the tier's budget
        or the tenant's share of it; `take_order` reserved them, so this holds unless the
        reservation was wrong."""
        if len(self._held(tier) | pages) > self._budget(tier):
            raise PinRefused(f"the {tier} tier's pin budget ({self._budget(tier)} pages) is full")
        if tenant is not None and len(self._held(tier, tenant) | pages) > self._tenant_budget(tier):
            raise PinRefused(f"this tenant's share of the {tier} tier's pin budget ({self._tenant_budget(tier)} pages) is full")

    def _held(self, tier: str, tenant: str | None = None) -> set[int] | set[bytes]:
        """The distinct pool pages (tier "memory") or disk keys ("disk") the tier's pins hold:
        every pin's, or one tenant's (never None: the share is not counted without tenants)."""
        pins = [p for p in self._pins.values() if p.tier == tier and (tenant is None or p.tenant == tenant)]
        if tier == "memory":
            return {page for p in pins for page in p.pages}
        return {key for p in pins for key in p.keys}

    def _reserved(self, tier: str, tenant: str | None = None) -> int:
        """The pages the tier's pins being made may add: every order's, or one tenant's."""
        return sum(o.pages for o in self._orders.values() if o.tier == tier and (tenant is None or o.tenant == tenant))
