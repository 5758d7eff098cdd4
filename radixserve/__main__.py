"""The command line: `radixserve serve --model default --port 30000` (or `python -m radixserve`).

Every `ServerConfig` field is an option (`page_size` <-> `--page-size`), generated from the
dataclass so the two cannot drift; `HELP` documents each one.

`serve` runs everything the HTTP server needs in one process tree: this process binds the port
(failing fast if it is taken), starts the scheduler and worker processes, then runs uvicorn with
the front (tokenizer manager) in uvicorn's event loop. SIGINT/SIGTERM: stop accepting, let
in-flight requests finish for up to `--shutdown-timeout` seconds, then stop the scheduler and
worker and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

from radixserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOG_LEVELS,
    POLICIES,
    QUANTIZATIONS,
    TOOL_CALL_PARSERS,
    ServerConfig,
)
from radixserve.version import __version__

if typing.TYPE_CHECKING:
    from radixserve.protocol import WorkerInfo

log = logging.getLogger("radixserve")

API_KEY_ENV = "RADIXSERVE_API_KEY"

HELP = {
    "model": "model to serve: 'default' (SmolLM2-135M-Instruct), a Hugging Face folder, or a .gguf file",
    "dtype": "weights and KV dtype; auto picks bfloat16 where the hardware runs it fast, else float32",
    "device": "where the model runs: auto, cpu, cuda, or cuda:K for GPU K of several; auto picks cuda "
    "when available, else cpu",
    "attention_backend": "paged attention kernels; auto picks flashinfer on cuda when it is installed "
    "(pip install radixserve[cuda]), else torch_native",
    "disable_cuda_graph": "on cuda, run decode steps eagerly instead of replaying captured CUDA graphs",
    "page_size": "tokens per KV page (the unit of caching and allocation)",
    "chunk_size": "prompt tokens computed per step at most (chunked prefill budget); deep in a long context "
                  "a chunk is shorter, so that its attention costs no more than a prompt's first chunk",
    "max_running_requests": "sequences decoded together at most",
    "max_queued_requests": "sequences waiting at most, pins waiting to be computed included; beyond it "
    "requests and pins get 503 with Retry-After",
    "kv_pages": "KV pool size in pages (overrides --kv-memory-gb)",
    "kv_memory_gb": "KV pool size in GiB when --kv-pages is not given",
    "kv_cache_dtype": "what the KV pool stores: auto (the model's dtype), bfloat16, float32, or 8 bits "
    "an element, twice the tokens in the same memory: fp8_e4m3, fp8_e5m2, int8 (a scale per token "
    "and KV head); quantized once when stored, read directly by the attention kernels",
    "quantization": "how a GGUF model's weights are held on the CPU: gguf keeps the file's quantized "
    "blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; other types are dequantized), read by kernels that "
    "dequantize inside the dot product; none dequantizes every tensor to --dtype",
    "context_len": "cap on prompt + output tokens of one request (default: the model's limit)",
    "schedule_policy": "waiting-queue order: lpm (longest cached prefix first) or fcfs",
    "disable_radix_cache": "keep the paging but cache no prefixes (the benchmark baseline)",
    "segment_recompute_ratio": "share of a request's reused segment tokens recomputed in context "
    "(those whose KV deviates most), 0 to 1; a request's segment_recompute_ratio overrides it",
    "disable_segment_cache": "serve a request's segments as an ordinary prompt: no segment cache, no blending",
    "kv_disk_dir": "a disk tier under the prefix cache: pages evicted from the KV pool are written "
    "here and read back for a later request with the same prefix, also after a restart "
    "(off by default; a directory it creates is made 0700, an existing one must already be private)",
    "kv_disk_gb": "the disk tier's budget in GiB; least recently used pages are deleted beyond it",
    "max_pinned_fraction": "the share of the KV pool (and of the disk budget) that /cache/pin may "
    "hold, so pins never starve running requests",
    "max_pinned_share_per_tenant": "with --api-key-file, the share of that pin budget (pins being made "
    "included) one tenant's pins may hold, so no tenant takes it all; beyond it a pin gets 409 at once "
    "(1: no share; without --api-key-file the clients share the whole budget)",
    "max_pins_in_flight_per_tenant": "pins one tenant may have queued or computing at once; beyond it "
    "/cache/pin gets 429 with Retry-After (without --api-key-file every client counts as one tenant)",
    "seed": "sampling seed for requests that bring none",
    "debug_checks": "cross-check KV page accounting after every step (slow; for debugging)",
    "grammar_compile_timeout": "CPU seconds the compile of a constrained request's grammar (json_schema, "
    "regex, ebnf, structural_tag, tools) may use; then it is killed and the request gets 400",
    "startup_timeout": "seconds the model may take to load",
    "speculative_algorithm": "speculative decoding: ngram (prompt lookup; NGRAM also accepted) drafts the "
    "next tokens from the request's own prompt and output and checks them in one forward; outputs "
    "are the same as without it (off by default)",
    "speculative_num_draft_tokens": "the most draft tokens checked per step and request (a request's "
    "drafts start at 2 tokens and double while accepted whole)",
    "speculative_ngram_min_match_window_size": "shortest suffix of the sequence looked up for a draft",
    "speculative_ngram_max_match_window_size": "longest suffix of the sequence looked up for a draft",
    "speculative_max_batch_size": "no drafting while more sequences than this decode, or while prompts "
    "are prefilled (a compute-bound step gains nothing from it)",
    "max_restarts": "when the scheduler or worker dies, start fresh ones and resume every request in "
    "flight, up to this many times within --restart-window; past that, requests fail with 503 and "
    "the server exits non-zero (0: no restarts)",
    "restart_window": "seconds over which --max-restarts counts restarts",
    "num_threads": "threads of the worker's forward (torch, oneDNN and the CPU kernels' OpenMP pools); "
    "default: one per --cpu-affinity core, else torch's default",
    "cpu_affinity": "pin the worker to these cores, e.g. 0-15 or 0,2,4-7 (replicas sharing a machine); "
    "the scheduler and front then run on the other cores this process may use, if any",
    "disable_adaptive_threads": "keep the CPU worker on all its threads even while other processes "
    "keep them waiting for a core (by default it gives up a thread while that happens, and tries "
    "it again later)",
    "host": "address to listen on; 127.0.0.1 keeps the server local (use 0.0.0.0 with --api-key)",
    "port": "TCP port to listen on",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health and the chat "
    f"page's files (or set ${API_KEY_ENV})",
    "api_key_file": "a file of API keys, one per line as 'KEY', 'KEY TENANT' or 'KEY TENANT admin' (# "
    "comments): each key's requests get their tenant's own prefix cache, and /metrics and "
    "/server_info show a key only its tenant's numbers (all of them to admin keys); replaces --api-key",
    "allowed_origins": "web origins (scheme://host[:port], comma-separated or repeated; * for any) whose "
    "pages may call the API from a browser (CORS); a request from any other foreign Origin gets 403. "
    "The server's own origin (the chat page) needs no entry",
    "allowed_hosts": "names (or name:port; * for any) the Host header may give besides the bound "
    "--host and port (and localhost, 127.0.0.1, [::1] when bound to loopback); any other Host gets 421, "
    "which stops DNS-rebinding pages. Bound to 0.0.0.0 or :: without this option, any Host is accepted",
    "served_model_name": "the model id in the OpenAI API (/v1/models, the 'model' field); default: --model",
    "disable_web_ui": "serve no chat page at GET / (it is on by default: a page that talks to "
    "/v1/chat/completions and shows each reply's cached tokens)",
    "max_body_bytes": "largest request body accepted, in bytes (413 beyond)",
    "health_timeout": "seconds the scheduler and worker have to answer a /health check",
    "header_timeout": "seconds a client has to send a request's line and headers, from connecting "
    "or from its first byte; a slower connection is closed",
    "body_timeout": "seconds a client has to send a request's body once its headers are in; a "
    "slower one gets 408 and the connection is closed",
    "shutdown_timeout": "on SIGINT/SIGTERM, seconds in-flight requests get to finish (new ones get 503 "
    "meanwhile); then, or at a second signal, the rest fail",
    "tool_call_parser": "the format the model writes tool calls in (/v1/chat/completions with tools): "
    "hermes (qwen is the same) or llama3; auto picks llama3 for a chat template that mentions "
    "<|python_tag|> or ipython, else hermes",
    "log_level": "logging level of every process",
}
_CHOICES = {
    "dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "quantization": QUANTIZATIONS,
    "attention_backend": ATTENTION_BACKENDS,
    "schedule_policy": POLICIES, "log_level": LOG_LEVELS, "tool_call_parser": TOOL_CALL_PARSERS,
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the absent ones (None, False) that the help text explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="An LLM serving runtime built around prefix caching.")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve", help="serve a model over HTTP (native /generate and an OpenAI-compatible API)",
        description="Serve a model over HTTP: /generate, /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /server_info, /flush_cache.",
        formatter_class=_HelpFormatter,
    )
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        _add_option(serve_parser, f, hints[f.name])
    return parser


def _add_option(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    if f.name not in HELP:
        raise KeyError(f"ServerConfig.{f.name} has no help text in radixserve.__main__.HELP")
    flag = "--" + f.name.replace("_", "-")
    if hint is bool:
        action = "store_true" if f.default is False else argparse.BooleanOptionalAction
        parser.add_argument(flag, action=action, default=f.default, help=HELP[f.name])
        return
    if typing.get_origin(hint) is tuple:  # a list: repeated or comma-separated, split by ServerConfig
        parser.add_argument(flag, action="append", type=str, default=None, metavar=f.name.upper().removesuffix("S"),
                            help=HELP[f.name])
        return
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `int | None`: the non-None type
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    metavar = None if f.name in _CHOICES else f.name.upper()
    parser.add_argument(
        flag, type=hint, default=f.default, choices=_CHOICES.get(f.name), metavar=metavar, help=HELP[f.name],
    )


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    if values["api_key"] is None and os.environ.get(API_KEY_ENV):
        if values["api_key_file"] is not None:
            parser.error(f"--api-key-file replaces --api-key: unset ${API_KEY_ENV} (or put that key in the file)")
        values["api_key"] = os.environ[API_KEY_ENV]
    try:
        config = ServerConfig(**values)
        if config.api_key_file is not None:  # before the model loads: a bad file fails in a second
            from radixserve.http.tenants import load_api_key_file

            load_api_key_file(config.api_key_file)
        return config
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    _exit_without_teardown(serve(config_from_args(args, parser)))


def _exit_without_teardown(code: int) -> NoReturn:
    """Ends the server's process once `serve` has stopped all it started (the engine's processes
    joined, their socket folder removed, the port closed). Python's teardown of the modules a
    server imports, torch among them, takes longer than that whole shutdown, and whatever
    restarts the server (a supervisor, a rolling deploy, a test suite) waits for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------- serve


class _Signals:
    """SIGINT/SIGTERM outside uvicorn's run (while the model loads) interrupt start-up; uvicorn
    handles them while it runs, and re-raises the one it got when it is done: then, a no-op."""

    def __init__(self) -> None:
        self.uvicorn_running = False

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        if not self.uvicorn_running:
            raise KeyboardInterrupt


def serve(config: ServerConfig) -> int:
    import uvicorn

    from radixserve.http.app import create_app
    from radixserve.http.connection import deadline_protocol
    from radixserve.http.drain import ERROR_GRACE_S, DrainingServer
    from radixserve.launch import Backend, StartupError
    from radixserve.placement import pin_current_process
    from radixserve.tokenizer import import_in_background, load_tokenizer

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sock = _bind(config.host, config.port)  # before the model loads: a taken port fails in a second
    signals = _Signals()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signals)
    log.info("loading %s ...", config.model)
    backend = Backend(config)
    state = None  # the app's ServerState, once it exists
    try:
        importing = import_in_background()
        ready = backend.start()
        importing.join()
        if backend.placement.service_cpus is not None:  # the front keeps off the worker's cores
            pin_current_process(backend.placement.service_cpus)
        app = create_app(config, backend, ready, load_tokenizer(ready.model_path))
        state = app.state.server
        _log_ready(config, ready, backend.placement.describe())
        server = DrainingServer(uvicorn.Config(
            app, log_level=config.log_level, lifespan="on",
            http=deadline_protocol(config.header_timeout, config.body_timeout),
            timeout_graceful_shutdown=ERROR_GRACE_S,  # the drain itself takes --shutdown-timeout
        ), state, config.shutdown_timeout)
        signals.uvicorn_running = True
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("interrupted; shutting down")
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    finally:
        signals.uvicorn_running = False
        backend.stop()
        sock.close()
    if state is not None and (lost := state.engine_lost) is not None:
        log.error("stopped: the engine could not be restarted (%s)", lost)
        return 1
    log.info("stopped")
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"radixserve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _log_ready(config: ServerConfig, ready: WorkerInfo, placement: str) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    log.info(
        "model %s (%s), dtype %s, device %s, CPU ISA %s, context %d tokens",
        config.model_name, ready.model_path, ready.dtype, ready.device, ready.cpu_isa, ready.context_len,
    )
    log.info("%s", placement)
    log.info(
        "KV pool: %d pages x %d tokens = %d tokens; radix cache %s",
        ready.total_pages, ready.page_size, ready.total_pages * ready.page_size,
        "off" if config.disable_radix_cache else "on",
    )
    log.info("serving at http://%s:%d%s", host, config.port, _auth_note(config))


def _auth_note(config: ServerConfig) -> str:
    if config.api_key_file is not None:
        return f" (API keys of {config.api_key_file} required)"
    return " (API key required)" if config.api_key else ""


if __name__ == "__main__":
    sys.exit(main())
