"""Turn serving-benchmark result files into a report: a Markdown table with ratios against the
baselines, the targets of the suite (met or missed, by how much), and PNG plots.

    python -m bench.report bench/results/serving.json [--out-dir bench/results]

Writes `<stem>_report.md`, `<stem>_throughput.png` (output tokens/s per workload and system),
`<stem>_ttft.png` (mean TTFT per workload and system), `<stem>_ttft_cdf.png` and
`<stem>_tpot_cdf.png` (per-request distributions, one panel per workload).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import new_parser
from bench.serving import RunResult, load_results, markdown_table

OURS, CACHE_OFF = "radixserve", "radixserve cache off"
HF_ONE, HF_STATIC = "transformers one-at-a-time", "transformers static batching"


@dataclass(frozen=True)
class Target:
    what: str
    value: float
    goal: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        return self.value >= self.goal if self.higher_is_better else self.value <= self.goal

    def row(self) -> str:
        if math.isnan(self.value):
            return f"| {self.what} | not measured | {self._goal()} | - |"
        verdict = "met" if self.met else f"**missed** by {abs(self.value - self.goal) / self.goal:.0%}"
        return f"| {self.what} | {self.value:.2f} | {self._goal()} | {verdict} |"

    def _goal(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='} {self.goal:g}"


def _find(runs: Sequence[RunResult], workload: str, system: str) -> RunResult | None:
    return next((r for r in runs if r.workload == workload and r.system == system), None)


def _ratio(runs: Sequence[RunResult], workload: str, a: str, b: str, key: str = "output_throughput") -> float:
    ra, rb = _find(runs, workload, a), _find(runs, workload, b)
    if ra is None or rb is None or not rb.metrics[key]:
        return math.nan
    return ra.metrics[key] / rb.metrics[key]


def targets(runs: Sequence[RunResult]) -> list[Target]:
    """The suite's targets (the ratio each comparison must reach: radixserve against the
    transformers baselines and against itself with the prefix cache off), computed from the runs
    that are there."""
    rag = _find(runs, "rag", OURS)
    warm_cold = (rag.metrics["mean_ttft_warm_ms"] / rag.metrics["mean_ttft_cold_ms"]) if rag else math.nan
    return [
        Target("rag: output tok/s, radixserve / transformers one-at-a-time", _ratio(runs, "rag", OURS, HF_ONE), 5),
        Target("rag: output tok/s, radixserve / radixserve cache off", _ratio(runs, "rag", OURS, CACHE_OFF), 3),
        Target("rag: mean TTFT, document cached / not cached (radixserve)", warm_cold, 0.2, higher_is_better=False),
        Target("chat: output tok/s, radixserve / cache off", _ratio(runs, "chat", OURS, CACHE_OFF), 2),
        Target("fewshot: output tok/s, radixserve / cache off", _ratio(runs, "fewshot", OURS, CACHE_OFF), 2),
        Target("unique: output tok/s, radixserve / cache off", _ratio(runs, "unique", OURS, CACHE_OFF), 0.95),
        Target("unique: output tok/s, radixserve / transformers static batching",
               _ratio(runs, "unique", OURS, HF_STATIC), 1.0),
    ]


def ratio_table(runs: Sequence[RunResult]) -> str:
    """Per workload and system: throughput and mean TTFT, and the throughput ratio of radixserve
    (cache on) over each system."""
    lines = [
        "| workload | system | requests | out tok/s | mean TTFT ms | cache hit | radixserve speed-up |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ours = _find(runs, r.workload, OURS)
        speedup = ours.metrics["output_throughput"] / r.metrics["output_throughput"] if ours and r.metrics["output_throughput"] else math.nan
        system = r.system + (f" ({r.note})" if r.note else "")
        lines.append(
            f"| {r.workload} | {system} | {r.metrics['completed']:.0f} | {r.metrics['output_throughput']:.1f} | "
            f"{r.metrics['mean_ttft_ms']:.0f} | {r.metrics['cache_hit_fraction']:.2f} | "
            f"{'-' if math.isnan(speedup) else f'{speedup:.2f}x'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots


def _systems(runs: Sequence[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.system for r in runs))


def _workloads(runs: Sequence[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.workload for r in runs))


def _bars(runs: Sequence[RunResult], key: str, ylabel: str, title: str, path: Path, log: bool) -> None:
    import matplotlib.pyplot as plt

    workloads, systems = _workloads(runs), _systems(runs)
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads)), 4))
    for i, system in enumerate(systems):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            r = _find(runs, w, system)
            if r is not None and not math.isnan(r.metrics[key]):
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(r.metrics[key])
        ax.bar(xs, ys, width, label=system)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdfs(runs: Sequence[RunResult], values: Any, xlabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    workloads = _workloads(runs)
    cols = min(3, len(workloads))
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, w in zip(axes.flat, workloads):
        for system in _systems(runs):
            r = _find(runs, w, system)
            xs = sorted(v * 1000 for v in values(r)) if r else []
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=system, drawstyle="steps-post")
        ax.set_title(w)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("fraction of requests")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(runs: Sequence[RunResult], out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    paths = [out_dir / f"{stem}_{name}.png" for name in ("throughput", "ttft", "ttft_cdf", "tpot_cdf")]
    _bars(runs, "output_throughput", "output tokens/s", "Output throughput (higher is better)", paths[0], log=True)
    _bars(runs, "mean_ttft_ms", "mean TTFT, ms", "Time to first token (lower is better)", paths[1], log=True)
    _cdfs(runs, lambda r: [x.ttft for x in r.requests if x.ok], "TTFT, ms", paths[2])
    _cdfs(runs, lambda r: [t for x in r.requests if (t := x.tpot) is not None], "TPOT, ms", paths[3])
    return paths


# ---------------------------------------------------------------------- the report


def make_report(results: Path, out_dir: Path | None = None) -> Path:
    """Write the Markdown report and the plots of one results file; returns the report's path."""
    results = Path(results)
    out_dir = Path(out_dir or results.parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta, runs = load_results(results)
    stem = results.stem
    images = plots(runs, out_dir, stem)
    first = {}  # workload -> its first run (the radixserve one, where there is one: it has every request)
    for r in runs:
        first.setdefault(r.workload, r)
    params = "\n".join(
        f"- `{w}`: {r.metrics['completed'] + r.metrics['errors']:.0f} requests; "
        + ", ".join(f"{k}={v}" for k, v in r.params.items())
        for w, r in first.items()
    )
    timings = meta.get("timings_s") or {}
    lines = [
        f"# Serving benchmark: {meta.get('model', '?')}, {meta.get('dtype', '?')}",
        "",
        f"{meta.get('date', '')}; {meta.get('cpus', '?')} CPUs, torch {meta.get('torch', '?')} "
        f"({meta.get('torch_threads', '?')} threads); concurrency {meta.get('concurrency', '?')}; "
        f"seed {meta.get('seed', '?')}; greedy, fixed output lengths.",
        "",
        "## Targets",
        "",
        "| target | measured | goal | verdict |",
        "|---|---:|---:|---|",
        *(t.row() for t in targets(runs)),
        "",
        "## Throughput and TTFT",
        "",
        ratio_table(runs),
        "",
        "## All metrics",
        "",
        markdown_table(runs),
        "",
        "TTFT warm/cold: mean TTFT of requests sent after another request of the same group (document, "
        "conversation, agent) had its first token, i.e. whose shared prefix had been computed, vs the others.",
        "",
        "## Workloads",
        "",
        params,
        "",
        "## Plots",
        "",
        *(f"![{p.stem}]({p.name})" for p in images),
    ]
    if timings:
        lines += ["", "## Where the suite's time went", "", "| phase | s |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in timings.items()]
    path = out_dir / f"{stem}_report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args(argv)
    print(make_report(args.results, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
