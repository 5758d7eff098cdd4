"""A run: a plan sent by concurrent clients, every answer judged, the engine watched, the page
accounting checked once idle, a plain stream timed beside it (`probe`); the figures as a `Report`."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.robustness.fuzz.client import Answer, send
from bench.robustness.fuzz.encoding import json_or_none
from bench.robustness.fuzz.oracle import (
    PIN_ROUTES,
    Outcome,
    check_rules,
    error_code,
    error_message,
    judge,
    must_refuse_request,
    unexplained_aborts,
)
from bench.robustness.fuzz.probe import StreamProbe, probe_figures, worst_gap
from bench.robustness.fuzz.request import GENERATING, FuzzRequest, Target

# a prompt at the edge of the context (8k tokens for the default model) takes a loaded 2-core
# machine over a minute to prefill: it gets this many timeouts
LONG_PROMPT_TIMEOUTS = 4


@dataclass
class Report:
    """The figures of a run; `ok` when the oracle found nothing."""

    planned: int = 0
    requests: int = 0  # sent: fewer than planned when the engine died
    duration_s: float = 0.0
    by_route: Counter = field(default_factory=Counter)
    by_status: Counter = field(default_factory=Counter)
    status_classes: Counter = field(default_factory=Counter)
    by_tag: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)  # allowed special cases: left, overloaded, ...
    problems: Counter = field(default_factory=Counter)
    hangs: int = 0
    engine_dead: str | None = None  # why, once a dead engine was seen
    health_failures: int = 0
    engine_restarts: int = 0
    after: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)  # the plain stream's gaps, idle and during the run
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, with their requests
    # the plan's requests (indexes) that plain clients sent and the server served (2xx): the
    # valid load, sent again alone as the probe's control (`control_plan`); not in the figures
    served: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.problems and not self.hangs and not self.engine_dead and not self.health_failures
                and not self.engine_restarts and self.after.get("balanced", False))

    def add_failure(self, kind: str, detail: str, req: FuzzRequest | None = None, limit: int = 50,
                    **context: Any) -> None:
        """Count a problem; keep its first few kinds of detail, each with a request showing it (and
        what else was going on, for a hang: `context`)."""
        self.problems[kind] += 1
        seen = {(f["kind"], f["detail"][:60]) for f in self.failures}
        if len(self.failures) < limit and ((kind, detail[:60]) not in seen or context):
            self.failures.append({"kind": kind, "detail": detail, "request": req.describe() if req else None, **context})

    def to_json(self) -> dict[str, Any]:
        out = {k: dict(v.most_common()) if isinstance(v, Counter) else v for k, v in self.__dict__.items()
               if k != "served"}
        return {"ok": self.ok, **out}


async def run_plan(url: str, plan: Sequence[FuzzRequest], *, concurrency: int = 8, timeout: float = 60.0,
                   check_every: float = 5.0, idle_timeout: float = 120.0, probe: bool = True,
                   progress: Callable[[int, Report], None] | None = None) -> Report:
    """Send `plan` with `concurrency` clients, checking each answer, the engine's health and
    pids every `check_every` seconds, and the page accounting once idle at the end. A dead
    engine ends the run early, naming the requests in flight then (and the last ones before).
    With `probe`, a plain stream is timed on the idle server first, then beside the plan."""
    info = await _get_json(url, "/server_info")
    stream_probe = StreamProbe(url, timeout=timeout) if probe else None
    if stream_probe is not None:
        await asyncio.to_thread(stream_probe.measure_idle)
    no_keepalive = httpx.Limits(max_connections=4 * concurrency, max_keepalive_connections=0)  # no reuse races
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=no_keepalive) as client:
        run = _Run(client, plan, Target.from_info(info), info["pids"], timeout)
        begin = time.monotonic()
        if stream_probe is not None:
            stream_probe.start_during()
        try:
            await run.send_all(concurrency, check_every, progress)
        finally:
            if stream_probe is not None:
                await asyncio.to_thread(stream_probe.finish)
        await run.finish(idle_timeout)
    if stream_probe is not None:
        run.add_probe(stream_probe)
    run.report.duration_s = round(time.monotonic() - begin, 1)
    return run.report


class _Run:
    """One run's clients, monitor and findings."""

    def __init__(self, client: httpx.AsyncClient, plan: Sequence[FuzzRequest], target: Target,
                 pids: dict[str, int], timeout: float) -> None:
        self.client, self.plan, self.target, self.pids, self.timeout = client, plan, target, pids, timeout
        self.report = Report(planned=len(plan))
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, FuzzRequest] = {}
        self.recent: deque[int] = deque(maxlen=20)  # the last requests answered
        self.pinned: set[int] = set()  # pins the plan made: unpinned before the pages are counted

    async def send_all(self, concurrency: int, check_every: float, progress: Callable[[int, Report], None] | None) -> None:
        indexes = iter(range(len(self.plan)))

        async def client_loop() -> None:
            for i in indexes:
                if self.report.engine_dead:
                    return
                self.outcomes.append(await self._one(i))
                if progress is not None and len(self.outcomes) % max(1, len(self.plan) // 10) == 0:
                    progress(len(self.outcomes), self.report)

        async def monitor() -> None:
            while True:
                await asyncio.sleep(check_every)
                await self.check_health()

        watch = asyncio.ensure_future(monitor())
        try:
            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        finally:
            watch.cancel()

    async def finish(self, idle_timeout: float) -> None:
        report = self.report
        for o in unexplained_aborts(self.outcomes):
            detail = f"sequences {o.aborted} ended in abort with no abort call for them"
            report.add_failure("unexplained-abort", detail, self.plan[o.index])
        await self.check_health()
        report.after = await _after(self.client, idle_timeout, self.pinned)
        if not report.after["balanced"]:
            report.add_failure("pages", json.dumps(report.after))

    def add_probe(self, probe: StreamProbe) -> None:
        """The probe's figures, with the plan's requests in flight across its worst gap during
        the run (what held the stream up). A stream of it that failed is a problem like any
        request's, and so is one aborted with no `abort_all` of the plan running meanwhile."""
        self.report.probe = probe_figures(probe.streams["idle"], probe.streams["during"])
        window = worst_gap(probe.streams["during"])
        if window is not None:
            overlapping = [o for o in self.outcomes if o.start < window[1] and o.end > window[0]]
            self.report.probe["during"]["worst_gap_in_flight"] = [
                {"route": o.route, "status": o.status, "body_bytes": self.plan[o.index].size(),
                 "tags": list(self.plan[o.index].tags)} for o in overlapping
            ]
        abort_alls = [o for o in self.outcomes if o.abort_call is not None and o.abort_call[1]]
        for phase, streams in probe.streams.items():
            for times in streams:
                if times.end.startswith("failed"):
                    self.report.add_failure("probe", f"{phase}: {times.end}")
                start, end = times.span
                if times.end == "aborted" and not any(c.start <= end and c.end >= start for c in abort_alls):
                    self.report.add_failure("unexplained-abort", f"a probe stream ({phase}) ended in abort with no abort_all meanwhile")

    async def _one(self, i: int) -> Outcome:
        req, report = self.plan[i], self.report
        report.requests += 1
        report.by_route[req.route] += 1
        report.by_tag.update(req.tags)
        self.in_flight[i] = req
        start = time.monotonic()
        limit = self.timeout * (LONG_PROMPT_TIMEOUTS if "long-prompt" in req.tags else 1)
        try:
            ans = await asyncio.wait_for(send(self.client, req, timeout=limit + 5), limit)  # httpx's must not fire first
        except asyncio.TimeoutError:
            report.hangs += 1
            others = [self.plan[j].describe(limit=300) for j in self.in_flight if j != i]
            report.add_failure("hang", f"no answer in {limit:g} s", req, server=await self._load(), in_flight=others)
            return Outcome(i, req.route, None, start, time.monotonic(), note="hang")
        finally:
            del self.in_flight[i]
            self.recent.append(i)
        outcome = Outcome(i, req.route, ans.status, start, time.monotonic())
        try:
            self._check(i, req, ans, outcome)
        except Exception as exc:  # noqa: BLE001 - the fuzzer's own bug: reported, the run goes on
            report.add_failure("fuzzer-error", f"{type(exc).__name__}: {exc}", req)
        finally:
            req.forget()
        return outcome

    def _check(self, i: int, req: FuzzRequest, ans: Answer, outcome: Outcome) -> None:
        report = self.report
        outcome.problems, outcome.note = judge(req, ans, self.target.max_body_bytes)
        if ans.status is not None:
            report.by_status[str(ans.status)] += 1
            if req.mode == "plain" and 200 <= ans.status < 300:
                report.served.append(i)
            report.status_classes[f"{ans.status // 100}xx"] += 1
            refusal = must_refuse_request(req, self.target)
            if refusal is not None and not ans.left and ans.status != refusal[0]:
                outcome.problems.append(("not-refused", f"answered {ans.status}; the rules say {refusal[0]}: {refusal[1]}"))
            if req.route in GENERATING or req.route in PIN_ROUTES:
                check_rules(req, ans, outcome, self.target)
            if ans.status == 200 and req.route == "/cache/pin":
                answer = json_or_none(ans.body)
                if isinstance(answer, dict) and type(answer.get("pin_id")) is int:
                    self.pinned.add(answer["pin_id"])
            if ans.status == 200 and req.route == "/abort_request":
                body = req.sent_json()
                if isinstance(body, dict):
                    rid = body.get("rid")
                    outcome.abort_call = (rid if isinstance(rid, str) else None, body.get("abort_all") is True)
            if ans.status == 503 and error_code(ans.body) == "engine_dead":
                self.engine_died(error_message(ans.body) or "engine_dead", exclude=i)
        if outcome.note:
            report.notes[outcome.note] += 1
        for kind, detail in outcome.problems:
            report.add_failure(kind, detail, req)

    async def _load(self) -> Any:
        """What the server is doing now (running and waiting requests, pages), for a report."""
        try:
            info = (await self.client.get("/server_info", timeout=10)).json()
            return {"requests": info.get("requests"), "pages": info.get("pages")}
        except (httpx.HTTPError, ValueError) as exc:
            return f"/server_info: {type(exc).__name__}: {exc}"

    def engine_died(self, reason: str, exclude: int | None = None) -> None:
        """The first sign of a dead engine: name the suspects, and stop sending."""
        if self.report.engine_dead:
            return
        self.report.engine_dead = reason
        suspects = [*self.in_flight, *reversed(self.recent)]
        self.report.failures.insert(0, {
            "kind": "engine-dead", "detail": reason,
            "suspects": [self.plan[i].describe(limit=600) for i in dict.fromkeys(suspects) if i != exclude],
        })

    async def check_health(self) -> None:
        """/health is 200 and the engine's processes are the ones the run began with."""
        report = self.report
        try:
            health = await self.client.get("/health")
            info = (await self.client.get("/server_info")).json()
        except (httpx.HTTPError, ValueError) as exc:
            report.health_failures += 1
            report.add_failure("health", f"{type(exc).__name__}: {exc}")
            self.engine_died(f"the server did not answer /health: {type(exc).__name__}: {exc}")
            return
        if health.status_code != 200:
            report.health_failures += 1
            report.add_failure("health", f"/health answered {health.status_code}: {health.text[:300]}")
            if "died" in health.text or "not running" in health.text:
                self.engine_died(health.text[:300])
        if info.get("pids") != self.pids:
            report.engine_restarts += 1
            report.add_failure("engine-restart", f"pids {self.pids} became {info.get('pids')}")
            self.pids = info.get("pids") or {}


def control_plan(plan: Sequence[FuzzRequest], report: Report) -> list[FuzzRequest]:
    """The run's valid load alone: the requests plain clients sent and the server served, in
    the plan's order. Run with the probe beside it, it tells what the hostile requests added to
    the probe's gaps, apart from what a server busy with the same valid work shows anyway."""
    return [plan[i] for i in sorted(report.served)]


async def _get_json(url: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return (await client.get(path)).raise_for_status().json()


async def _after(client: httpx.AsyncClient, idle_timeout: float, pinned: set[int]) -> dict[str, Any]:
    """Once nothing runs or waits, and the pins of the plan still held (`pins_left`) are
    unpinned: every page free or cached, none held."""
    deadline = time.monotonic() + idle_timeout
    pins_left = 0
    try:
        while True:
            info = (await client.get("/server_info")).json()
            idle = info["requests"] == {"running": 0, "waiting": 0}
            if idle or info["requests"] is None or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        if idle and pinned:
            pins_left = await _unpin(client, pinned)
            info = (await client.get("/server_info")).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"idle": False, "error": f"{type(exc).__name__}: {exc}", "balanced": False}
    pages = info["pages"]
    balanced = idle and pages["in_use"] == 0 and pages["free"] + pages["evictable"] + pages["in_use"] == pages["total"]
    return {"idle": idle, "pages": pages, "requests": info["requests"], "pins_left": pins_left, "balanced": balanced}


async def _unpin(client: httpx.AsyncClient, pinned: set[int]) -> int:
    """Unpin the pins of `pinned` still listed (a pin's pages are held on purpose, and the run
    leaves the server as it found it); how many there were."""
    listed = (await client.get("/cache/pins")).raise_for_status().json()["pins"]
    held = [p["pin_id"] for p in listed if p["pin_id"] in pinned]
    for pin_id in held:
        await client.post("/cache/unpin", json={"pin_id": pin_id})
    return len(held)


def print_report(report: Report, file: Any = sys.stdout) -> None:
    out = report.to_json()
    verdict = "OK" if report.ok else "PROBLEMS FOUND"
    print(f"fuzz: {report.requests} of {report.planned} requests sent in {report.duration_s} s: {verdict}", file=file)
    for key in ("by_route", "status_classes", "by_status", "notes", "problems", "by_tag"):
        print(f"  {key}: {json.dumps(out[key])}", file=file)
    print(f"  hangs: {report.hangs}, engine dead: {report.engine_dead}, health failures: {report.health_failures}, "
          f"engine restarts: {report.engine_restarts}", file=file)
    print(f"  after: {json.dumps(report.after)}", file=file)
    if report.probe:
        idle, during = report.probe["idle"], report.probe["during"]
        print(f"  probe: worst gap idle {idle['worst_gap_ms']} ms, during the run {during['worst_gap_ms']} ms: "
              f"{report.probe['worst_gap_ratio']}x", file=file)
        for phase in ("idle", "during"):
            figures = {k: v for k, v in report.probe[phase].items() if k != "worst_gap_in_flight"}
            print(f"    {phase}: {json.dumps(figures)}", file=file)
        for o in report.probe["during"].get("worst_gap_in_flight", []):
            print(f"    in flight across the worst gap: {o['route']} {o['status']} {o['body_bytes']} bytes "
                  f"{' '.join(o['tags'])}", file=file)
    for failure in report.failures[:10]:
        print(f"  FAILURE {json.dumps(failure)[:1500]}", file=file)
