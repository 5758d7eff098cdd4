"""The CPU kernels of another git revision against this checkout's, on the default model's
forward, in one process, alternating: what a kernel change buys end to end, as a ratio.

    python -m bench.kernel_revisions --against HEAD~1 [--dtype bfloat16] [--repeats 5]

The other revision's radixserve/kernels/csrc (its .c and .h files, read with `git show`) is
built with this checkout's flags for the tier in use; every kernel call of the model goes to
one library, then the other, per case. The weights are packed once, by this checkout, so the
two revisions must agree on the packed layout (`linear_panel_width`); the largest difference
between their logits is printed beside each case (0 where a change keeps the same sums).

Cases: prefills of 64, 700 and 1,536 tokens; over 700 tokens of context, a decode step and
checks of drafts of 2, 4, 8 and 16 tokens (3, 5, 9 and 17 rows, all logits).
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import add_dtype, new_parser, torch_dtype
from bench.model_runner import Ours, machine
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa
from radixserve.worker.model_runner import SequenceChunk

CSRC = "radixserve/kernels/csrc"
CONTEXT = 700


def build_revision(revision: str, workdir: Path) -> ctypes.CDLL:
    """The kernel library of `revision`'s sources, for the tier in use."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    src = workdir / "csrc"
    src.mkdir()
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], check=True,
                                  capture_output=True).stdout
            (src / name).write_bytes(text)
    target = workdir / "revision.so"
    flags = cpu_kernels.COMPILE_FLAGS + isa.compile_flags(isa.selected_tier())
    cpu_kernels._build(cpu_kernels._compiler(), target, sorted(src.glob("*.c")), compile_flags=flags)
    lib = ctypes.CDLL(str(target))
    cpu_kernels._declare(lib)
    return lib


def cases(ours: Ours) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, a forward returning its logits), each on its own page-table row."""
    vocab = ours.vocab
    prompt = torch.randint(100, vocab - 100, (1536,), generator=torch.Generator().manual_seed(0)).tolist()
    ours._assign(2, 1536 + 64)
    out: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for n in (64, 700, 1536):
        out.append((f"prefill {n} tokens", lambda n=n: ours.runner.forward([SequenceChunk(0, 0, prompt[:n])]).last_logits))
    ours.runner.forward([SequenceChunk(1, 0, prompt[:CONTEXT])])  # row 1's context, stored once
    for rows in (1, 3, 5, 9, 17):
        name = "decode step" if rows == 1 else f"draft of {rows - 1} checked"
        out.append((f"{name}, {CONTEXT} context", lambda rows=rows: torch.cat(
            ours.runner.forward([SequenceChunk(1, CONTEXT, prompt[CONTEXT : CONTEXT + rows], all_logits=True)]).all_logits)))
    return out


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--against", required=True, help="the git revision whose kernels are the baseline")
    add_dtype(parser, choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    isa.selected_tier()  # before torch's first matmul: it caps torch's kernels for a lower tier
    dtype = torch_dtype(args.dtype)
    ours = Ours(dtype)
    here = cpu_kernels.load_library()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_revision(args.against, Path(tmp))
        if baseline.linear_panel_width() != here.linear_panel_width():
            raise SystemExit(f"{args.against} packs linear weights in panels of {baseline.linear_panel_width()} columns, "
                             f"this checkout in {here.linear_panel_width()}: not comparable")
        libraries = {args.against: baseline, "this checkout": here}
        print(machine(), f"{str(dtype).removeprefix('torch.')}, median of {args.repeats}")
        print(f"| case | {args.against} ms | this checkout ms | ratio (time) | max logit difference |")
        print("|---|---:|---:|---:|---:|", flush=True)
        real_load = cpu_kernels.load_library
        try:
            for name, forward in cases(ours):
                times: dict[str, list[float]] = {k: [] for k in libraries}
                logits: dict[str, torch.Tensor] = {}
                for _ in range(args.repeats):
                    for label, lib in libraries.items():
                        cpu_kernels.load_library = lambda tier=None, lib=lib: lib
                        start = time.perf_counter()
                        logits[label] = forward()
                        times[label].append(time.perf_counter() - start)
                a, b = (1e3 * sorted(times[k])[len(times[k]) // 2] for k in libraries)
                diff = (logits[args.against].float() - logits["this checkout"].float()).abs().max().item()
                print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} | {diff:.3g} |", flush=True)
        finally:
            cpu_kernels.load_library = real_load


if __name__ == "__main__":
    main()
