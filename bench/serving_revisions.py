"""The serving benchmark of another git revision against this checkout, in alternating rounds:
whether a change (a restructure that should change nothing, say) moved serving throughput.

    python -m bench.serving_revisions --against fe5e1d4 [--rounds 3] [--workload rag --workload chat]

The other revision is checked out into a temporary git worktree. Each round runs
`python -m bench.serving --launch` once from that worktree and once from this checkout (which
goes first alternates from round to round), each starting its own server on the default model,
so both sides meet the same drift of a shared machine. Each side's figures come from its own
bench/serving.py, so the load generator is each revision's own. The medians over rounds per
workload and their ratio (this checkout / the other) are printed and written with every round
to `--out` (bench/results/serving_revisions.json), for bench/report_docs.py.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import add_out, new_parser
from bench.model_runner import machine

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def run_side(checkout: Path, workloads: list[str], out: Path) -> dict[str, dict[str, float]]:
    """One bench.serving run from `checkout`: each workload's metrics."""
    cmd = [sys.executable, "-m", "bench.serving", "--launch", "--out", str(out), "--no-progress"]
    for workload in workloads:
        cmd += ["--workload", workload]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    runs = json.loads(out.read_text())["runs"]
    return {run["workload"]: {m: run["metrics"][m] for m in METRICS} for run in runs}


def medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    workloads = rounds[0].keys()
    return {w: {m: statistics.median(r[w][m] for r in rounds) for m in METRICS} for w in workloads}


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--against", required=True, help="the other git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", action="append", help="repeatable; default: rag and chat")
    add_out(parser, "bench/results/serving_revisions.json")
    args = parser.parse_args()
    workloads = args.workload or ["rag", "chat"]
    head = git("rev-parse", "--short", "HEAD")
    against = git("rev-parse", "--short", args.against)
    sides: dict[str, list[dict[str, dict[str, float]]]] = {"this": [], "against": []}
    with tempfile.TemporaryDirectory(prefix="radixserve-rev-") as tmp:
        other = Path(tmp) / "checkout"
        git("worktree", "add", "--detach", str(other), against)
        try:
            for round_no in range(args.rounds):
                order = ["against", "this"] if round_no % 2 == 0 else ["this", "against"]
                for side in order:
                    checkout = other if side == "against" else ROOT
                    figures = run_side(checkout, workloads, Path(tmp) / f"{side}_{round_no}.json")
                    sides[side].append(figures)
                    print(f"round {round_no + 1} {side}: " + ", ".join(
                        f"{w} {f['output_throughput']:.1f} out tok/s" for w, f in figures.items()), flush=True)
        finally:
            git("worktree", "remove", "--force", str(other))
    this, base = medians(sides["this"]), medians(sides["against"])
    ratios = {w: {m: this[w][m] / base[w][m] for m in METRICS} for w in workloads}
    for w in workloads:
        print(f"{w}: output tok/s median {this[w]['output_throughput']:.1f} (this, {head}) vs "
              f"{base[w]['output_throughput']:.1f} ({against}): {ratios[w]['output_throughput']:.2f}x")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cpu": machine(), "this": head,
        "this_uncommitted": bool(git("status", "--porcelain")), "against": against,
        "workloads": workloads, "rounds": args.rounds, "metrics": list(METRICS),
        "median": {"this": this, "against": base}, "ratio": ratios, "each_round": sides,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
