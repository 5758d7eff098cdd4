"""One options object, built from CLI flags or Engine keyword arguments, passed to every process.

Engine keyword arguments use the CLI flag names with underscores (`--page-size` -> `page_size`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from radixserve import placement

DTYPES = ("auto", "float32", "bfloat16", "float16")
# what the KV pool stores (kernels/kv_quant.py): auto is the model's dtype; the 8-bit kinds hold
# twice the tokens (the fp8 names are SGLang's and vLLM's)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "int8")
# how a GGUF model's weights are held (models/gguf_quantized.py): gguf keeps the file's quantized
# blocks for the CPU kernels that read them; none dequantizes them to the model's dtype
QUANTIZATIONS = ("gguf", "none")
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:K", one GPU of several (see _check_device)
POLICIES = ("lpm", "fcfs")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ATTENTION_BACKENDS = ("auto", "flashinfer", "torch_native")
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen", "llama3")  # http/openai/tool_call_parser.py owns the formats


@dataclass(frozen=True)
class ServerConfig:
    """Every runtime option. Validated on construction; derived values are properties."""

    model: str = "default"
    dtype: str = "auto"  # auto: bf16 where it is faster (CUDA; CPUs from the avx2 ISA tier up)
    device: str = "auto"
    attention_backend: str = "auto"  # auto: flashinfer on CUDA when installed, else torch_native
    disable_cuda_graph: bool = False  # CUDA only: run decode steps eagerly instead of replaying graphs
    page_size: int = 16
    chunk_size: int = 512  # per-step budget of prompt tokens to compute (chunked prefill)
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    kv_pages: int | None = None  # KV pool size in pages; None: from kv_memory_gb
    kv_memory_gb: float = 2.0
    kv_cache_dtype: str = "auto"
    quantization: str = "gguf"
    context_len: int | None = None  # cap on prompt + output tokens; None: the model's limit
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # segments (docs/cache.md): a request's `segments` reuse cached KV wherever they sit, with
    # this share of their tokens recomputed by default; disabled: segments are a plain prompt
    segment_recompute_ratio: float = 0.15
    disable_segment_cache: bool = False
    # the disk tier under the radix tree (cache/disk_index.py, worker/kv_disk.py): None = off
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 16.0  # disk budget; least recently used pages go first
    max_pinned_fraction: float = 0.5  # of the KV pool (and of the disk budget) pins may hold
    # per tenant of api_key_file (scheduler/pins.py): its share of that pin budget, and its pins
    # queued or computing at once (without tenants, every client together is one tenant)
    max_pinned_share_per_tenant: float = 0.5
    max_pins_in_flight_per_tenant: int = 4
    seed: int = 0  # for requests that bring no seed of their own
    debug_checks: bool = False  # cross-check page accounting after every step
    grammar_compile_timeout: float = 5.0  # CPU seconds a grammar's compile may use, then 400
    startup_timeout: float = 300.0
    # speculative decoding (scheduler/ngram.py): None = off; "ngram" (SGLang's "NGRAM" too)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8  # the most draft tokens verified per step (`python -m bench.speculative`)
    speculative_ngram_min_match_window_size: int = 2  # shortest suffix looked up
    speculative_ngram_max_match_window_size: int = 4  # longest suffix looked up
    speculative_max_batch_size: int = 8  # no drafting when more sequences decode (compute-bound)
    # recovery (front/recovery.py): a dead scheduler or worker is restarted, its requests resumed
    max_restarts: int = 3  # restarts allowed within restart_window; 0: a crash fails everything
    restart_window: float = 300.0  # seconds
    # CPU placement (radixserve/placement.py): replicas sharing a machine pin their workers apart
    num_threads: int | None = None  # the worker's thread pools; None: one per --cpu-affinity core, else torch's default
    cpu_affinity: str | None = None  # the worker's cores, e.g. "0-15" or "0,2,4-7"; None: not pinned
    # a CPU worker gives up a thread while other processes keep its threads waiting (worker/thread_governor.py)
    disable_adaptive_threads: bool = False
    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    api_key_file: str | None = None  # one key per line, `key [tenant [admin]]`: a tenant per key (http/tenants.py)
    # browsers (http/origins.py): foreign origins allowed to call the API (CORS), `*` for any;
    # Host names the server answers to besides its bound address (`*` for any)
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    served_model_name: str | None = None  # the model id of the OpenAI API; None: `model`
    disable_web_ui: bool = False  # GET / serves no chat page (http/web_ui.py): a 404 as on any unknown route
    max_body_bytes: int = 32 * 1024 * 1024  # largest request body accepted (413 above)
    health_timeout: float = 10.0  # /health: seconds the scheduler and worker have to answer
    header_timeout: float = 10.0  # seconds a client has to send a request's head (else closed)
    body_timeout: float = 60.0  # seconds a client has to send a request's body (else 408, closed)
    shutdown_timeout: float = 10.0  # on SIGINT/SIGTERM: seconds to let in-flight requests finish
    tool_call_parser: str = "auto"  # how the model writes tool calls; auto: from its chat template
    log_level: str = "info"

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _check_device(self.device)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.attention_backend == "flashinfer" and self.device == "cpu":
            raise ValueError("attention_backend 'flashinfer' needs CUDA; use device cuda or auto, or attention_backend torch_native")
        _choice("schedule_policy", self.schedule_policy, POLICIES)
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        _at_least("page_size", self.page_size, 1)
        _at_least("chunk_size", self.chunk_size, 1)
        _at_least("max_running_requests", self.max_running_requests, 1)
        _at_least("max_queued_requests", self.max_queued_requests, 1)
        if self.kv_pages is not None:
            _at_least("kv_pages", self.kv_pages, 2)
        if self.kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        if self.kv_disk_gb <= 0:
            raise ValueError(f"kv_disk_gb must be > 0, got {self.kv_disk_gb}")
        if not 0 <= self.segment_recompute_ratio <= 1:
            raise ValueError(f"segment_recompute_ratio must be in [0, 1], got {self.segment_recompute_ratio}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if not 0 < self.max_pinned_share_per_tenant <= 1:
            raise ValueError(f"max_pinned_share_per_tenant must be in (0, 1], got {self.max_pinned_share_per_tenant}")
        _at_least("max_pins_in_flight_per_tenant", self.max_pins_in_flight_per_tenant, 1)
        if self.kv_disk_dir is not None and self.disable_radix_cache:
            raise ValueError("kv_disk_dir needs the prefix cache: it cannot go with disable_radix_cache")
        if self.context_len is not None:
            _at_least("context_len", self.context_len, 2)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _at_least("max_body_bytes", self.max_body_bytes, 1)
        _at_least("max_restarts", self.max_restarts, 0)
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm.lower() != "ngram":
                raise ValueError(f"speculative_algorithm must be ngram (or NGRAM), got {self.speculative_algorithm!r}")
            object.__setattr__(self, "speculative_algorithm", "ngram")
        _at_least("speculative_num_draft_tokens", self.speculative_num_draft_tokens, 1)
        _at_least("speculative_ngram_min_match_window_size", self.speculative_ngram_min_match_window_size, 1)
        _at_least("speculative_ngram_max_match_window_size", self.speculative_ngram_max_match_window_size,
                  self.speculative_ngram_min_match_window_size)
        _at_least("speculative_max_batch_size", self.speculative_max_batch_size, 1)
        for name in ("grammar_compile_timeout", "health_timeout", "header_timeout", "body_timeout", "shutdown_timeout",
                     "startup_timeout", "restart_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.api_key is not None and self.api_key_file is not None:
            # the single key would be a tenant whose salt names raw namespaces, other tenants' included
            raise ValueError("give either api_key or api_key_file, not both (put the key in the file)")
        object.__setattr__(self, "allowed_origins", _name_list("allowed_origins", self.allowed_origins, normalize_origin))
        object.__setattr__(self, "allowed_hosts", _name_list("allowed_hosts", self.allowed_hosts, normalize_host))
        if self.num_threads is not None:
            _at_least("num_threads", self.num_threads, 1)
        if self.cpu_affinity is not None:
            placement.plan(self.num_threads, self.cpu_affinity)  # raises on a bad or unusable list

    @property
    def model_name(self) -> str:
        """The model's id in the OpenAI API (`/v1/models`, the `model` field of requests)."""
        return self.served_model_name or self.model

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> ServerConfig:
        """Build from Engine keyword arguments, naming any unknown option."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def to_dict(self, hide_paths: bool = False) -> dict[str, object]:
        """The options, with the API key hidden (for /server_info and logs); with `hide_paths`,
        the key file's and the disk tier's paths too (what a tenant's key sees)."""
        out = dataclasses.asdict(self)
        hidden = ("api_key", "api_key_file", "kv_disk_dir") if hide_paths else ("api_key",)
        for name in hidden:
            if out[name] is not None:
                out[name] = "***"
        return out


def _name_list(name: str, value: object, normalize: Callable[[str], str]) -> tuple[str, ...]:
    """A list option given as a comma-separated string, or a sequence of them (the CLI's
    repeated flag): every entry normalized (ValueError naming the option), duplicates dropped."""
    items = [value] if isinstance(value, str) else list(value or ())  # type: ignore[call-overload]
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{name} must be strings, got {item!r}")
        for part in item.split(","):
            if part.strip():
                try:
                    out.append(normalize(part))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
    return tuple(dict.fromkeys(out))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_device(value: str) -> None:
    """`auto`, `cpu`, `cuda`, or `cuda:K` for GPU K (whether it exists is the worker's check,
    the only process that imports torch)."""
    if value not in DEVICES and not (isinstance(value, str) and re.fullmatch(r"cuda:[0-9]{1,4}", value)):
        raise ValueError(f"device must be one of {list(DEVICES)} or cuda:K (a GPU index), got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# ---------------------------------------------------------------------- --allowed-origins, --allowed-hosts
# (the rules they feed are http/origins.py's)


def normalize_origin(value: str) -> str:
    """`scheme://host[:port]` in lower case (default ports dropped), or `*`; ValueError else."""
    value = value.strip()
    if value == "*":
        return value
    parts = urlsplit(value.lower())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query \
            or parts.fragment or parts.username or parts.password:
        raise ValueError(f"an allowed origin must be `*` or scheme://host[:port] (http or https), got {value!r}")
    return f"{parts.scheme}://{_authority(parts.hostname, _port(parts), parts.scheme)}"


def normalize_host(value: str) -> str:
    """`name`, `name:port` or `[v6]:port` in lower case, or `*`; ValueError else."""
    value = value.strip().lower()
    if value == "*":
        return value
    name, port = split_host(value)
    if not name or "/" in value or "@" in value or (port is not None and not 0 < port < 65536):
        raise ValueError(f"an allowed host must be `*`, a name or name:port, got {value!r}")
    return value


def split_host(value: str) -> tuple[str, int | None]:
    """A `Host` header's name (IPv6 in brackets) and port; the port is None when absent and -1
    when unreadable (which matches nothing)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return "", -1
        name, rest = value[: end + 1], value[end + 1 :]
        if not rest:
            return name, None
        if not rest.startswith(":"):
            return "", -1
        port = rest[1:]
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:  # a bare IPv6 address is not a valid Host
        return "", -1
    else:
        return value, None
    return name, int(port) if port.isdigit() and len(port) <= 5 else -1


def _authority(name: str, port: int | None, scheme: str) -> str:
    name = f"[{name}]" if ":" in name and not name.startswith("[") else name
    default = {"http": 80, "https": 443}[scheme]
    return name if port is None or port == default else f"{name}:{port}"


def _port(parts) -> int | None:
    try:
        return parts.port
    except ValueError:
        raise ValueError(f"a bad port in {parts.geturl()!r}") from None
