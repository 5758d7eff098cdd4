"""llama.cpp as a baseline: what CPU users serve GGUF files with today.

Two of its programs, from one build:
- `llama-server` (`LlamaServer`): the same GGUF file behind its OpenAI-compatible HTTP API, 2
  threads, `--parallel 8 --cont-batching -fa on`, driven by the serving benchmark's load
  generator and OpenAI client (bench/suite.py's `llama.cpp` system);
- `llama-batched-bench` (`BatchedBench`): decode and prefill speeds of one file at fixed batch
  sizes, beside radixserve's model runner (bench/quantized_weights.py).

The build is not part of the repo or of CI: it is made once, from the llama.cpp sources vendored
in the llama-cpp-python sdist, into a folder outside the repo (docs/benchmarks.md, "llama.cpp
baseline", has the commands). `bin_dir()` finds it: $RADIXSERVE_LLAMA_CPP_BIN, else
$RADIXSERVE_CACHE/llama.cpp/bin. Without a build the benchmarks skip llama.cpp and say so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import ServerProcess
from radixserve.paths import cache_dir

LLAMA_CPP_ENV = "RADIXSERVE_LLAMA_CPP_BIN"
THREADS = 2
SLOTS = 8  # llama-server's --parallel: its concurrent sequences
SLOT_CONTEXT = 4096  # tokens per slot (the context is split evenly between the slots)


def bin_dir() -> Path | None:
    """The `bin` folder of a llama.cpp build holding llama-server, or None."""
    where = os.environ.get(LLAMA_CPP_ENV)
    folder = Path(where).expanduser() if where else cache_dir() / "llama.cpp" / "bin"
    return folder if (folder / "llama-server").is_file() else None


def skip_line() -> str:
    """What a benchmark prints when it has no build to run."""
    return (f"llama.cpp: skipped, no build found (set {LLAMA_CPP_ENV} to the bin folder of one, or build "
            f"into {cache_dir() / 'llama.cpp'}; docs/benchmarks.md says how)")


def _env(folder: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(folder)}  # the build's shared libraries sit beside its programs


class LlamaServer(ServerProcess):
    """`llama-server` on a GGUF file, on a free loopback port, started at construction."""

    def __init__(self, folder: Path, gguf: Path, log_path: Path | None = None) -> None:
        self.folder = folder
        super().__init__(gguf, log_path=log_path, env=_env(folder))

    def command(self, model: Path | str, host: str, port: int, options: Sequence[str]) -> list[str]:
        return [str(self.folder / "llama-server"), "-m", str(model), "--host", host, "--port", str(port),
                "-t", str(THREADS), "-tb", str(THREADS), "--parallel", str(SLOTS), "--cont-batching",
                "-fa", "on", "-c", str(SLOTS * SLOT_CONTEXT), *options]

    def warm_up(self) -> None:
        """Two short completions (first-call costs), as radixserve's servers get."""
        body = {"prompt": "Warm-up: count from one to ten.", "max_tokens": 4, "ignore_eos": True}
        for _ in range(2):
            httpx.post(self.url + "/v1/completions", json=body, timeout=120).raise_for_status()


@dataclass
class BatchedBench:
    """`llama-batched-bench` on one file: decode and prefill speeds."""

    folder: Path

    def run(self, path: Path, prompt_len: int, gen_len: int, batches: tuple[int, ...]) -> list[dict[str, float]]:
        """One run: per batch size `pl`, prompt (`speed_pp`) and generation (`speed_tg`) tok/s."""
        cmd = [str(self.folder / "llama-batched-bench"), "-m", str(path), "-t", str(THREADS), "-tb", str(THREADS),
               "-fa", "on", "-c", str(max(batches) * (prompt_len + gen_len) + 64), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", ",".join(map(str, batches)),
               "--output-format", "jsonl"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **_env(self.folder)})
        if out.returncode != 0:
            raise RuntimeError(f"{cmd[0]} exited {out.returncode}: {out.stderr[-2000:]}")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if not rows:  # older builds print a Markdown table only
            rows = [{"pl": int(m[0]), "speed_pp": float(m[1]), "speed_tg": float(m[2])}
                    for m in re.findall(r"\|\s*\d+\s*\|\s*\d+\s*\|\s*(\d+)\s*\|.*?\|\s*([\d.]+)\s*\|[^|]*\|\s*([\d.]+)\s*\|",
                                        out.stdout)]
        return rows
