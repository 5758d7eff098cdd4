"""The scheduler's request lifecycle (scheduler/request.py): legal phase changes pass, illegal
ones raise naming both ends, and a request run through a tiny Scheduler (no processes) goes
WAITING -> PREFILLING -> DECODING -> FINISHED."""

from __future__ import annotations

import pytest

from radixserve.protocol import FinishReason, SamplingParams, TokenizedRequest
from radixserve.scheduler.core import Scheduler
from radixserve.scheduler.request import IllegalTransition, PromptLogprobs, Request, RequestPhase
from tests.unit.test_scheduler import FakeWorker, make

P = RequestPhase


def new_request(prompt_len: int = 10, **kw) -> Request:
    return Request(
        rid=0, index=0, input_ids=list(range(3, 3 + prompt_len)), sampling=SamplingParams(max_new_tokens=4),
        namespace=None, arrival=0, **kw,
    )


def running(req: Request, computed: int) -> Request:
    """As if admitted with `computed` tokens from the cache (the KV manager sets the lengths)."""
    req.computed_len = computed
    req.admit()
    return req


def test_a_new_request_waits_and_one_with_a_grammar_waits_for_it():
    assert new_request().phase is P.WAITING
    req = new_request(grammar_wait=object())  # type: ignore[arg-type]  # any pending compile
    assert req.phase is P.WAITING_FOR_GRAMMAR and req.waits_for_grammar
    req.grammar_compiled(matcher=object())  # type: ignore[arg-type]
    assert req.phase is P.WAITING and req.grammar_wait is None and req.matcher is not None


def test_admission_prefills_or_decodes_when_the_cache_held_all_but_the_last_token():
    assert running(new_request(10), 0).phase is P.PREFILLING
    assert running(new_request(10), 9).phase is P.DECODING


def test_admit_says_whether_it_is_the_first_admission():
    req = new_request()
    assert req.admit() is True
    req.retract()
    assert req.admit() is False


def test_progress_turns_a_prefill_into_a_decode():
    req = running(new_request(10), 0)
    req.add_computed(8)
    assert req.phase is P.PREFILLING
    req.add_computed(2)  # the whole prompt: the next token is sampled
    req.append_output(42)
    assert req.phase is P.DECODING
    req.add_computed(1)
    req.append_output(43)
    assert req.phase is P.DECODING and req.output_ids == [42, 43]


def test_a_retracted_request_waits_again_and_keeps_its_output():
    req = running(new_request(10), 0)
    req.add_computed(10)
    req.append_output(42)
    req.reset_kv()
    req.retract()
    assert req.phase is P.WAITING and req.output_ids == [42]
    assert running(req, 0).phase is P.PREFILLING  # its context is computed again


def test_every_live_phase_can_end():
    grammar = new_request(grammar_wait=object())  # type: ignore[arg-type]
    for req in (grammar, new_request(), running(new_request(), 0), running(new_request(10), 9)):
        req.end(FinishReason("abort", message="aborted"))
        assert req.finished and req.finish is not None and req.finish.type == "abort"


@pytest.mark.parametrize(
    ("setup", "step", "message"),
    [
        (lambda r: None, lambda r: r.retract(), "WAITING -> WAITING"),
        (lambda r: None, lambda r: r.grammar_compiled(object()), "WAITING -> WAITING"),
        (lambda r: r.end(FinishReason("length")), lambda r: r.end(FinishReason("length")), "FINISHED -> FINISHED"),
        (lambda r: r.end(FinishReason("length")), lambda r: r.admit(), "FINISHED -> PREFILLING"),
        (lambda r: running(r, 0), lambda r: r.admit(), "PREFILLING -> PREFILLING"),
        (lambda r: running(r, 9), lambda r: r.grammar_compiled(object()), "DECODING -> WAITING"),
    ],
)
def test_illegal_transitions_raise_naming_both_ends(setup, step, message):
    req = new_request(10)
    setup(req)
    before = req.phase
    with pytest.raises(IllegalTransition, match=message):
        step(req)
    assert req.phase is before


def test_a_request_waiting_for_its_grammar_cannot_be_admitted():
    req = new_request(grammar_wait=object())  # type: ignore[arg-type]
    with pytest.raises(IllegalTransition, match="WAITING_FOR_GRAMMAR -> PREFILLING"):
        req.admit()


def test_decoding_never_goes_back_to_prefilling_without_a_retraction():
    req = running(new_request(10), 9)
    req.computed_len = 0  # a bookkeeping bug: the phase check catches it at the next progress
    with pytest.raises(IllegalTransition, match="DECODING -> PREFILLING"):
        req.add_computed(1)


def test_prompt_logprobs_are_collected_completed_and_sent_once():
    assert new_request().prompt_logprobs is PromptLogprobs.NOT_ASKED
    req = new_request(10, return_logprob=True, logprob_start_len=2)
    assert req.prompt_logprobs is PromptLogprobs.COLLECTING and req.wants_input_logprobs
    req.append_output(42)
    assert req.prompt_logprobs is PromptLogprobs.COMPLETE and not req.wants_input_logprobs
    req.prompt_logprobs_sent()
    req.prompt_logprobs_complete()  # no going back
    assert req.prompt_logprobs is PromptLogprobs.SENT


def _step_phases(sched: Scheduler, worker: FakeWorker) -> list[RequestPhase]:
    """Step until idle; the phase of the one request after each step (admission included)."""
    req = sched.waiting[0]
    phases = [req.phase]
    while (batch := sched.build_batch()) is not None:
        phases.append(req.phase)
        sched.process_result(worker.step(batch))
        phases.append(req.phase)
        sched.take_messages()
    return phases


def test_a_request_through_the_scheduler_waits_prefills_decodes_and_finishes():
    sched, worker = make(chunk_size=8)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    assert sched.add_request(TokenizedRequest(900, list(range(100, 120)), sampling)) is None  # 20 tokens
    phases = _step_phases(sched, worker)
    distinct = [p for i, p in enumerate(phases) if i == 0 or p is not phases[i - 1]]
    assert distinct == [P.WAITING, P.PREFILLING, P.DECODING, P.FINISHED]
    assert phases.count(P.PREFILLING) >= 3  # 20 tokens in chunks of 8


def test_a_retracted_request_goes_back_to_waiting_and_finishes_with_every_token():
    sched, worker = make()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    assert sched.add_request(TokenizedRequest(901, list(range(100, 110)), sampling)) is None
    sched.process_result(worker.step(sched.build_batch()))
    req = sched.running[0]
    assert req.phase is P.DECODING and len(req.output_ids) == 1
    sched._retract(req)  # as when pages run out
    assert req.phase is P.WAITING and req in sched.waiting and len(req.output_ids) == 1
    phases = _step_phases(sched, worker)
    assert phases[-1] is P.FINISHED and len(req.output_ids) == 4
    assert P.PREFILLING in phases or P.DECODING in phases


def test_admitting_a_running_request_again_raises():
    req = running(new_request(10), 9)
    with pytest.raises(IllegalTransition, match="DECODING -> DECODING"):
        req.admit()
    req = running(new_request(10), 0)
    req.computed_len = 9
    with pytest.raises(IllegalTransition, match="PREFILLING -> DECODING"):
        req.admit()  # legal as progress, not as an admission
