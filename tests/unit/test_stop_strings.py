"""Stop strings across the two processes: the scheduler decides where a match is, the front cuts there.

The real `Scheduler` with its real `StopChecker` is driven by a worker that replays a script of
tokens, and its outputs are fed to the front's real `SampleOutput`, both with the default
model's tokenizer. The front's text must be the scheduler's character for character (the cut
lands on the stop string), the cut must be at the first match that completes at or after
`min_new_tokens`, and the text a stream shows must never shrink.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.config import ServerConfig
from radixserve.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from radixserve.front.sample_output import PromptLogprobs, SampleOutput
from radixserve.protocol import (
    ChunkResult,
    ForwardBatch,
    ForwardResult,
    SamplingParams,
    TokenBatchOut,
    TokenizedRequest,
    WorkerInfo,
    WorkerReady,
)
from radixserve.scheduler.core import Scheduler
from radixserve.scheduler.stop import StopChecker

PROMPT = [9825, 42]  # "Count:"
HYPOTHESIS = settings(max_examples=120, deadline=None)


@pytest.fixture(scope="module")
def vocab(smol: Any) -> list[int]:
    """Whole-word tokens, digits and spaces, special tokens, and pieces of multi-byte characters."""
    words = smol(" 7 1 the cat, sat. on\n", add_special_tokens=False).input_ids
    partial = [i for i in range(20_000, 21_000) if REPLACEMENT_CHAR in smol.decode([i])][:4]
    emoji = smol("😀é", add_special_tokens=False).input_ids
    return sorted(set(words + partial + emoji + [0, 1, 2]))


class ScriptWorker:
    """Samples the script's j-th token as a request's j-th output token."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def step(self, batch: ForwardBatch) -> ForwardResult:
        results = []
        for c in batch.chunks:
            res = ChunkResult()
            if c.sample:
                res.next_token_id = self.script[c.prefix_len + len(c.token_ids) - len(PROMPT)]
            results.append(res)
        return ForwardResult(results, 0.0)


def serve(smol: Any, script: list[int], sampling: SamplingParams) -> tuple[SampleOutput, list[str]]:
    """Run one request through scheduler and front; the front's final state and each text it showed."""
    config = ServerConfig(page_size=4, debug_checks=True)
    ready = WorkerReady(WorkerInfo(64, 4, 256, len(smol), [2], "fake", "float32", "cpu", "avx2"))
    sched = Scheduler(config, ready, lambda req: StopChecker(smol, req.sampling, req.input_ids) if req.sampling.stop else None)
    assert sched.add_request(TokenizedRequest(0, PROMPT, sampling)) is None
    worker = ScriptWorker(script)
    front = SampleOutput(smol, sampling, PROMPT, PromptLogprobs())
    shown = []
    while (batch := sched.build_batch()) is not None:
        sched.process_result(worker.step(batch))
        for message in sched.take_messages():
            assert isinstance(message, TokenBatchOut)
            for out in message.outputs:
                front.apply(out)
                shown.append(front.visible_text)
    assert front.done
    return front, shown


def expected(smol: Any, script: list[int], sampling: SamplingParams) -> tuple[int, str | None, str]:
    """Tokens generated, the stop string that ended it, and the final text, found naively."""
    def texts(ids: list[int]) -> tuple[list[str], str]:
        d = IncrementalDetokenizer(
            smol, skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens, context_ids=PROMPT,
        )
        steps = [""]
        for t in ids:
            steps.append(steps[-1] + d.add([t]))
        return steps, steps[-1] + d.finish()

    steps, _ = texts(script)
    for k in range(max(sampling.min_new_tokens, 1), len(script) + 1):
        hits = []
        for s in sampling.stop:  # matches that end in the text token k added
            q = steps[k].find(s, max(0, len(steps[k - 1]) - len(s) + 1))
            if q >= 0:
                hits.append((q, len(s), s))
        if hits:
            position, _, stop = min(hits)
            _, text = texts(script[:k])
            assert text[position:].startswith(stop)
            return k, stop, text if sampling.no_stop_trim else text[:position]
    return len(script), None, texts(script)[1]


def check(smol: Any, script: list[int], sampling: SamplingParams) -> SampleOutput:
    front, shown = serve(smol, script, sampling)
    tokens, stop, text = expected(smol, script, sampling)
    assert front.output_ids == script[:tokens]
    assert front.finish == ({"type": "stop", "matched": stop} if stop else {"type": "length", "matched": None})
    assert front.text == text
    for before, after in zip(shown, shown[1:], strict=False):
        assert after.startswith(before), (before, after)  # a stream never takes text back
    return front


def test_a_stop_string_before_min_new_tokens_does_not_stop_nor_trim(smol):
    """Observed: the text " 7" after 13 tokens: the front cut at the first "7", which
    min_new_tokens had let through, instead of at the match that ended the request."""
    script = smol(" 7 1 7 2 7 3 7 4", add_special_tokens=False).input_ids
    sampling = SamplingParams(max_new_tokens=len(script), min_new_tokens=5, stop=["7"], ignore_eos=True)
    front = check(smol, script, sampling)
    assert front.text == " 7 1 " and len(front.output_ids) == 6  # the "7" of token 6 ended it
    kept = check(smol, script, SamplingParams(**{**_fields(sampling), "no_stop_trim": True}))
    assert kept.text == " 7 1 7"


def test_a_match_straddling_min_new_tokens_ends_the_request(smol):
    """ " ab ab ab", one token per " ab": the match completed by token 2 is text; the one token 3
    completes began in token 2's text, which the stream held back and the cut then drops."""
    script = smol(" ab ab ab", add_special_tokens=False).input_ids
    assert len(script) == 3
    sampling = SamplingParams(max_new_tokens=3, min_new_tokens=3, stop=["b a"], ignore_eos=True)
    assert check(smol, script, sampling).text == " ab a"


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


@HYPOTHESIS
@given(data=st.data())
def test_the_front_cuts_where_the_scheduler_matched(smol, vocab, data):
    script = data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=16))
    skip = data.draw(st.booleans())
    d = IncrementalDetokenizer(smol, skip_special_tokens=skip, context_ids=PROMPT)
    text = "".join(d.add([t]) for t in script) + d.finish()
    stops = []
    for _ in range(data.draw(st.integers(1, 2))):
        if text and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + data.draw(st.integers(1, 4))])
        else:
            stops.append(data.draw(st.text(alphabet=" 71a,.", min_size=1, max_size=3)))
    sampling = SamplingParams(
        max_new_tokens=len(script), min_new_tokens=data.draw(st.integers(0, len(script))),
        stop=sorted(set(stops)), ignore_eos=True, skip_special_tokens=skip,
        spaces_between_special_tokens=data.draw(st.booleans()),
        no_stop_trim=data.draw(st.booleans()),
    )
    check(smol, script, sampling)
