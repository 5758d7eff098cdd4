"""Hugging Face transformers baselines, run in-process on the same workloads, weights and dtype:

- `one at a time`: `model.generate` per request, sequentially (the "just use transformers"
  setup); a program's follow-up requests come right after the request they depend on.
- `static batching`: groups of `batch` ready requests, left-padded, through one batched
  `generate`; a group starts when the previous one has finished. Follow-ups join later groups.
- `continuous batching`: transformers' own `generate_batch` (paged attention, continuous
  batching; see `continuous_batching_works` for why the suite may leave it out).

Greedy, fixed output lengths (`min_new_tokens = max_new_tokens`), like the servers. Token times
come from a logits processor that records when each decoding step's logits are ready, so TTFT is
the time to the first token of the request (of its group, for static batching) and the
inter-token gaps are the decoding steps. Records use the same `RequestRecord`/`summarize` as the
load generator, so every metric means the same thing.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from bench.common import StepClock
from bench.serving import Progress, RequestRecord, RunResult, summarize
from bench.workloads import Node, Workload


class HFBaseline:
    def __init__(self, model: str = "default", dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from radixserve.models.resolve import resolve_model

        path = resolve_model(model)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self._generate(["Warm-up: count from one to ten."], 4)

    @torch.inference_mode()
    def _generate(self, prompts: list[str], max_tokens: int) -> tuple[list[str], list[int], list[float], float]:
        """Greedy batched generate with left padding: (outputs, prompt lengths, step times, start)."""
        from transformers import LogitsProcessorList

        encoded = [self.tokenizer(p).input_ids for p in prompts]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[self.pad_id] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        clock = StepClock()
        start = time.perf_counter()
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            pad_token_id=self.pad_id, logits_processor=LogitsProcessorList([clock]),
        )
        texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return texts, [len(e) for e in encoded], clock.times, start

    def _record(self, node: Node, t0: float, start: float, times: list[float], prompt_len: int, out: str) -> RequestRecord:
        return RequestRecord(
            group=node.group, sent=start - t0, ttft=times[0] - start, itl=[b - a for a, b in zip(times, times[1:])],
            e2e=times[-1] - start, prompt_tokens=prompt_len, output_tokens=len(times), output=out,
        )

    def one_at_a_time(self, workload: Workload, limit: int | None = None, progress: bool = True,
                      budget_s: float | None = None) -> RunResult:
        """Every request alone, in program order; with `limit`, only the first `limit` requests,
        with `budget_s`, only those started within that many seconds."""
        records: list[RequestRecord] = []
        total = min(limit or workload.num_requests, workload.num_requests)
        bar = Progress(total, f"{workload.name} on transformers one-at-a-time", progress)
        stack: list[tuple[Node, str]] = [(r, r.text) for r in reversed(workload.roots)]
        t0 = time.perf_counter()
        while stack and len(records) < total and not _over(t0, budget_s):
            node, prompt = stack.pop()
            (out,), (n,), times, start = self._generate([prompt], node.max_tokens)
            records.append(self._record(node, t0, start, times, n, out))
            stack.extend((c, prompt + out + c.text) for c in reversed(node.children))
            bar.update()
        duration = time.perf_counter() - t0
        bar.close()
        note = f"{len(records)} of {workload.num_requests} requests" if len(records) < workload.num_requests else ""
        return RunResult(workload.name, "transformers one-at-a-time", dict(workload.params),
                         {"concurrency": 1}, summarize(records, duration), records, note)

    def static_batched(self, workload: Workload, batch: int, limit: int | None = None,
                       progress: bool = True, budget_s: float | None = None) -> RunResult:
        """Groups of up to `batch` ready requests (follow-ups first), one `generate` per group;
        `limit` and `budget_s` as in `one_at_a_time` (whole groups)."""
        records: list[RequestRecord] = []
        total = min(limit or workload.num_requests, workload.num_requests)
        bar = Progress(total, f"{workload.name} on transformers static batching", progress)
        ready: deque[tuple[Node, str]] = deque((r, r.text) for r in workload.roots)
        t0 = time.perf_counter()
        while ready and len(records) < total and not _over(t0, budget_s):
            group = [ready.popleft() for _ in range(min(batch, len(ready), total - len(records)))]
            max_tokens = max(node.max_tokens for node, _ in group)
            outs, lens, times, start = self._generate([p for _, p in group], max_tokens)
            follow_ups = []
            for (node, prompt), out, n in zip(group, outs, lens, strict=True):
                records.append(self._record(node, t0, start, times[: node.max_tokens], n, out))
                follow_ups += [(c, prompt + out + c.text) for c in node.children]
                bar.update()
            ready.extendleft(reversed(follow_ups))
        duration = time.perf_counter() - t0
        bar.close()
        note = f"{len(records)} of {workload.num_requests} requests" if len(records) < workload.num_requests else ""
        return RunResult(workload.name, "transformers static batching", dict(workload.params),
                         {"concurrency": batch}, summarize(records, duration), records, note)

    def continuous_batching(self, workload: Workload, concurrency: int, progress: bool = True) -> RunResult:
        """transformers' `generate_batch` (continuous batching over paged attention, its block
        sharing on) over a flat workload, at most `concurrency` requests per batch."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if any(r.children for r in workload.roots):
            raise ValueError("continuous_batching measures flat workloads only (no follow-up requests)")
        inputs = [self.tokenizer(r.text).input_ids for r in workload.roots]
        max_tokens = max(r.max_tokens for r in workload.roots)
        config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=-1, pad_token_id=self.pad_id)
        page = 16
        cb = ContinuousBatchingConfig(  # sized like the servers: 512-token steps, `concurrency` rows
            page_size=page, num_blocks=sum(len(i) + max_tokens + page for i in inputs) // page + 64,
            max_batch_tokens=512, max_requests_per_batch=concurrency, use_cuda_graph=False,
        )
        t0 = time.perf_counter()
        outputs = self.model.generate_batch(inputs, generation_config=config, continuous_batching_config=cb,
                                            record_timestamps=True, progress_bar=progress, warmup=False)
        duration = time.perf_counter() - t0
        records = []
        for root, ids, out in zip(workload.roots, inputs, _ordered(outputs, len(inputs)), strict=True):
            times = out.timestamps or [out.lifespan[1]]
            # like a client's send: when the request left the waiting queue (scheduled), not its creation
            sent = out.lifespan[0] if out.lifespan[0] > 0 else out.created_time
            records.append(RequestRecord(
                group=root.group, sent=sent - t0, ttft=times[0] - sent,
                itl=[b - a for a, b in zip(times, times[1:])], e2e=times[-1] - sent,
                prompt_tokens=len(ids), output_tokens=len(out.generated_tokens), error=out.error,
                output=self.tokenizer.decode(out.generated_tokens, skip_special_tokens=True),
            ))
        return RunResult(workload.name, "transformers continuous batching", dict(workload.params),
                         {"concurrency": concurrency}, summarize(records, duration), records)


def _over(t0: float, budget_s: float | None) -> bool:
    return budget_s is not None and time.perf_counter() - t0 > budget_s


def _ordered(outputs: dict[str, Any], n: int) -> list[Any]:
    """generate_batch's results, which it returns in input order."""
    results = list(outputs.values())
    if len(results) != n:
        raise RuntimeError(f"generate_batch returned {len(results)} results for {n} requests")
    return results


__all__ = ["HFBaseline"]
