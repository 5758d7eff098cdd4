"""An HTTP fuzzer over every route of a running server, with an oracle checked as it goes: a
robustness tool, not a benchmark (what it finds are bugs; its speed is no figure).

    python -m bench.robustness.fuzz --requests 10000               # starts `serve --model default --dtype auto`
    python -m bench.robustness.fuzz --requests 10000 --model tiny  # a 2-layer random model, same tokenizer: fast
    python -m bench.robustness.fuzz --url http://127.0.0.1:30000 --requests 500

Requests are drawn by hypothesis strategies (written here, no schemathesis) from what the server
reports about itself (vocabulary, context, body limit, model name), as a plan fixed by `--seed`,
then sent by `--concurrency` clients at once. They mix valid bodies of every route with hostile
ones: ids, keys and numbers of the same shapes (unicode digits, "--5", 5,000-digit numbers, 1e-45,
1e308, NaN-ish strings), out-of-range counts, rids shared within a batch and across clients
(`x#1` next to `x` with n=2), odd logit_bias keys, long stop lists, wrong JSON types, unknown
fields with falsy values, repeated keys, streaming on and off, and, in small numbers, clients that
disconnect (mid-stream or before the answer), bodies at and over `--max-body-bytes`, bodies sent
in slow pieces or chunked. About a sixth of the plain requests belong to five hostile classes,
their shapes dealt in fixed proportions and tagged `<class>` and `<class>-<shape>`: `tools`
(parameters 200-300 levels deep, names of every JSON type, missing and extra fields, huge
descriptions, duplicate names, parameters no object), `tool_choice` (the valid strings, a named
function, a name that is a list, an object, a number, missing or unknown, `{"function": {}}`),
`schema` (response formats and `json_schema` 50-500 levels deep, remote and file `$ref`s, `not`,
conflicting `allOf`; deep regexes), `pin` (/cache/pin and /cache/unpin with ttl, tier, prefix
and pin_id of every wrong kind) and `cross-origin` (a foreign Origin or Host, a JSON body not
declared JSON, GET on routes that change state).

The oracle, per request (`judge`, `check_rules`): a 2xx, or a 4xx whose body is a JSON error with a
message that echoes no huge value back (never a 5xx but the documented 503 `overloaded`; never a
connection closed without an answer but for a body over the limit), an answer within `--timeout`
seconds, a stream that ends with `[DONE]` and no error event; a body that breaks a documented rule
refused (`must_refuse`: sampling, tools, schemas, pins), a request a browser rule refuses answered
with that rule's 4xx whatever its body (`must_refuse_request`: 421 foreign Host, 403 foreign
Origin, 405 wrong method, 415 not JSON), one result per sequence asked for, each labelled with the
rid the client gave, an OpenAI error naming a field the client sent, and no sequence aborted unless
an `/abort_request` for it (or `abort_all`) ran meanwhile. Every few seconds: `/health` is 200 and
the engine's pids are unchanged. After the run, once idle and the plan's pins unpinned: no request
running or waiting, and KV pages free + cached == total with none in use.

Beside the plan, the plain stream probe (`probe`) streams an ordinary /generate request (64
tokens, greedy) again and again from a process of its own and times the gaps between its chunks,
first on the idle server, then during the run: the report's `probe` gives both worst gaps and
their ratio (a measurement, not part of the verdict; `--no-probe` leaves it out).
docs/server.md ("Fuzzing") says the same for users.

The package, in the order a run uses it: `request` (the target, one request), `encoding` (JSON
beyond json.dumps), `values`, `schemas` (schemas, regexes, tools, tool choices) and `bodies`
(hypothesis strategies), `plan` (drawing a plan), `client` (sending), `oracle` (judging), `probe`
(the plain stream probe), `run` (a run and its report), `__main__` (the command).

Valid requests ask for at most `--max-new-tokens` tokens (64 for clients that leave), so a run
measures robustness, not decoding speed. The figures (requests by route and tag, status classes,
problems, hangs, engine restarts, pages after, the probe's gaps) are printed and written as JSON
(`--out`).
tests/server/test_fuzz_http.py runs a bounded plan against a tiny model in CI.
"""

from __future__ import annotations

from bench.robustness.fuzz.client import Answer, send
from bench.robustness.fuzz.encoding import Pad, Pairs, Raw, encode
from bench.robustness.fuzz.oracle import (
    Outcome,
    check_rules,
    judge,
    must_refuse,
    must_refuse_request,
    unexplained_aborts,
)
from bench.robustness.fuzz.plan import KINDS, MODES, draw_plan, fuzz_requests
from bench.robustness.fuzz.request import GENERATING, FuzzRequest, Target
from bench.robustness.fuzz.run import Report, print_report, run_plan

__all__ = [
    "GENERATING", "KINDS", "MODES", "Answer", "FuzzRequest", "Outcome", "Pad", "Pairs", "Raw", "Report", "Target",
    "check_rules", "draw_plan", "encode", "fuzz_requests", "judge", "must_refuse", "must_refuse_request",
    "print_report", "run_plan", "send", "unexplained_aborts",
]
