"""The runtime end to end: real scheduler and worker processes behind `Engine`.

Fast cases use a tiny random Llama with the real tokenizer; exactness against transformers on
the default model lives in test_engine_default_model.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from runtime_helpers import hf_greedy, pid_alive

from radixserve import Engine
from radixserve.front.types import EngineDead, InvalidRequest
from radixserve.models.config import ModelConfig

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, chunk_size=32, kv_pages=512, debug_checks=True) as eng:
        yield eng


def assert_pages_balanced(eng: Engine) -> None:
    """Once idle, every page is free or cached: nothing leaked to a finished request."""
    deadline = time.monotonic() + 5
    while True:
        s = eng.get_stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s["running_pages"] == 0, s
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s


def _prompts(eng: Engine, count: int) -> list[list[int]]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    out = []
    for i in range(count):
        text = " ".join(words[(i * 3 + j) % len(words)] for j in range(3 + (i * 7) % 40))
        out.append(eng.tokenizer(text).input_ids)
    return out


def test_greedy_matches_transformers_and_second_run_hits_cache(engine, tiny_dir):
    prompts = _prompts(engine, 4)
    expected = hf_greedy(tiny_dir, prompts, 12)
    first = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    assert [o["output_ids"] for o in first] == expected
    second = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    assert [o["output_ids"] for o in second] == expected
    assert [o["text"] for o in second] == [o["text"] for o in first]
    for p, o in zip(prompts, second):
        # the last prompt token is always computed (its logits give the first output token)
        assert o["meta_info"]["cached_tokens"] == (len(p) - 1) // 4 * 4
    assert_pages_balanced(engine)


def test_64_concurrent_requests_of_mixed_lengths(engine, tiny_dir):
    prompts = _prompts(engine, 64)
    expected = hf_greedy(tiny_dir, prompts, 6)
    engine.flush_cache()

    async def run_all():
        return await asyncio.gather(
            *(engine.async_generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 6}) for p in prompts)
        )

    outs = asyncio.run(run_all())
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
    assert_pages_balanced(engine)


def test_cache_salt_isolates_tenants(engine):
    engine.flush_cache()
    prompt = _prompts(engine, 30)[29]
    params = {**GREEDY, "max_new_tokens": 2}
    a1 = engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-a")
    b1 = engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-b")
    a2 = engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-a")
    shared = engine.generate(input_ids=prompt, sampling_params=params)
    assert a1["meta_info"]["cached_tokens"] == 0
    assert b1["meta_info"]["cached_tokens"] == 0
    assert a2["meta_info"]["cached_tokens"] > 0
    assert shared["meta_info"]["cached_tokens"] == 0
    assert a1["output_ids"] == b1["output_ids"] == a2["output_ids"] == shared["output_ids"]
    assert_pages_balanced(engine)


def test_streaming_is_cumulative_and_abort_frees_pages(engine):
    prompt = _prompts(engine, 10)[9]
    chunks = list(engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 10}, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["output_ids"] == engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 10})["output_ids"]
    for _ in range(3):
        stream = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 500, "ignore_eos": True}, stream=True)
        next(stream)
        next(stream)
        stream.close()  # the client went away
    assert_pages_balanced(engine)


def test_stop_strings_and_token_ids(engine):
    prompt = _prompts(engine, 12)[11]
    base = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20})
    ids, text = base["output_ids"], base["text"]
    stop_id = ids[5]
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == ids[: ids.index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    kept = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].endswith(stop) and stop in kept["text"]
    assert_pages_balanced(engine)


def test_n_samples_share_the_prompt_pages(engine):
    engine.flush_cache()
    prompt = _prompts(engine, 40)[39]
    outs = engine.generate(input_ids=prompt, sampling_params={"temperature": 1.0, "max_new_tokens": 4, "n": 3, "seed": 5})
    assert len(outs) == 3
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and cached[1] == cached[2] == (len(prompt) - 1) // 4 * 4
    again = engine.generate(input_ids=prompt, sampling_params={"temperature": 1.0, "max_new_tokens": 4, "n": 3, "seed": 5})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # seeds reproduce
    assert_pages_balanced(engine)


def test_prompt_logprobs_with_zero_new_tokens(engine, tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = _prompts(engine, 20)[19]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt and got[0][0] is None
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    ref = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert max(abs(a - b) for (a, _, _), b in zip(got[1:], ref)) < 1e-4
    # from the middle, with the earlier part cached
    start = len(prompt) // 2
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start)
    mid = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in mid] == prompt[start:]
    assert max(abs(a - b) for (a, _, _), b in zip(mid, ref[start - 1 :])) < 1e-4
    assert_pages_balanced(engine)


def test_bad_input_is_a_clear_error(engine):
    with pytest.raises(InvalidRequest, match="out of range"):
        engine.generate(input_ids=[1, 2, 10**9], sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(InvalidRequest):
        engine.generate("hi", {"max_new_tokens": 10**7})
    with pytest.raises(InvalidRequest, match="exactly one"):
        engine.generate()
    assert engine.generate("hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


SEGMENTS = ["Document 1: the quick brown fox.\n", "Document 2: seven wizards judge boxing.\n", "Question: who judges?"]


def _concatenated(eng: Engine, segments: list[str]) -> list[int]:
    from radixserve.tokenizer import encode, encode_continuation

    return encode(eng.tokenizer, segments[0]) + [t for s in segments[1:] for t in encode_continuation(eng.tokenizer, s)]


def test_generate_with_segments(engine):
    params = {**GREEDY, "max_new_tokens": 3, "ignore_eos": True}
    out = engine.generate(segments=SEGMENTS, sampling_params=params, segment_recompute_ratio=0.25)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(_concatenated(engine, SEGMENTS)) and meta["completion_tokens"] == 3
    assert 0 <= meta["recomputed_tokens"] <= meta["segment_tokens"] <= meta["cached_tokens"]
    streamed = list(engine.generate(segments=SEGMENTS, sampling_params=params, stream=True))
    assert streamed[-1]["meta_info"]["finish_reason"] is not None and "segment_tokens" in streamed[-1]["meta_info"]

    async def run() -> dict:
        return await engine.async_generate(segments=SEGMENTS, sampling_params=params)

    assert asyncio.run(run())["meta_info"]["prompt_tokens"] == meta["prompt_tokens"]
    with pytest.raises(InvalidRequest, match="`segments` cannot be combined with `text`"):
        engine.generate("hi", segments=SEGMENTS)
    with pytest.raises(InvalidRequest, match="`segment_recompute_ratio` must be a number from 0 to 1"):
        engine.generate(segments=SEGMENTS, segment_recompute_ratio=True)
    with pytest.raises(InvalidRequest, match=r"`segments\[0\]` must be a non-empty string"):
        engine.generate(segments=[""])
    assert_pages_balanced(engine)


def test_segments_with_the_segment_cache_off_equal_the_concatenated_prompt(tiny_dir):
    params = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=512, disable_segment_cache=True) as eng:
        out = eng.generate(segments=SEGMENTS, sampling_params=params)
        plain = eng.generate(input_ids=_concatenated(eng, SEGMENTS), sampling_params=params)
        assert out["output_ids"] == plain["output_ids"] and out["text"] == plain["text"]
        assert out["meta_info"]["segment_tokens"] == 0 and eng.get_stats()["segment_reused_tokens_total"] == 0


def test_a_callers_rid_is_a_label_that_cannot_reach_another_request(engine):
    """rid `x#1` once named sample 1 of rid `x` inside the runtime, and the worker died of it."""
    params = [{**GREEDY, "n": 2, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}]
    outs = engine.generate(["Hello", "World"], params, rid=["x", "x#1"])
    assert [o["meta_info"]["id"] for o in outs] == ["x", "x", "x#1"]
    assert outs[2]["meta_info"]["completion_tokens"] == 12
    assert outs[2]["output_ids"] == engine.generate("World", params[1])["output_ids"]
    with pytest.raises(InvalidRequest, match="'x' is given twice"):
        engine.generate(["Hello", "World"], rid=["x", "x"])
    assert_pages_balanced(engine)


def test_tiny_pool_retracts_and_matches_roomy_pool(tiny_dir):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(8 + i % 5)) for i in range(12)]
    params = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=512) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(texts, params)]
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=40, debug_checks=True) as tight:
        got = [o["output_ids"] for o in tight.generate(texts, params)]
        stats = tight.get_stats()
        assert stats["num_retractions_total"] > 0, stats
        assert_pages_balanced(tight)
    assert got == expected


def test_chunked_prefill_and_page_size_1(tiny_dir):
    prompts = [list(range(300, 300 + 90)), list(range(500, 500 + 37))]
    expected = hf_greedy(tiny_dir, prompts, 8)
    with Engine(model=str(tiny_dir), dtype="float32", page_size=1, chunk_size=16, kv_pages=1024, debug_checks=True) as eng:
        # the worker reports the model's attention cost, so chunks past the first shorten
        # (scheduler/step_cost.py), and the output is still transformers'
        assert eng.ready.context_token_cost == ModelConfig.from_folder(tiny_dir).context_token_cost > 0
        out = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8})
        assert [o["output_ids"] for o in out] == expected
        again = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8})
        assert [o["output_ids"] for o in again] == expected
        assert [o["meta_info"]["cached_tokens"] for o in again] == [89, 36]
        assert_pages_balanced(eng)


def test_shutdown_ends_the_scheduler_and_the_worker_cleanly(tiny_dir):
    """The scheduler stops the worker as it exits, so neither waits out the front's deadline
    (a process still there at its end is killed: exit code -9)."""
    engine = Engine(model=str(tiny_dir), dtype="float32", kv_pages=64)
    processes = engine._backend.processes
    started = time.monotonic()
    engine.shutdown()
    assert [p.exitcode for p in processes] == [0, 0]
    assert time.monotonic() - started < 5  # the front's deadline for the two


def test_killed_worker_resumes_a_generate_in_progress(tiny_dir):
    """The worker dies mid-request: a fresh engine takes over and the call returns the text it
    would have returned anyway (tests/server/test_recovery.py does this over HTTP, at length)."""
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=1024) as eng:
        params = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0.0}
        expected = eng.generate("hello there", params)
        first_worker = eng._backend.worker.pid
        outs: list[dict] = []
        flowing = threading.Event()

        def stream() -> None:
            for out in eng.generate("hello there", params, stream=True):
                outs.append(out)
                flowing.set()

        t = threading.Thread(target=stream)
        t.start()
        assert flowing.wait(60)
        os.kill(first_worker, 9)
        t.join(timeout=120)
        assert not t.is_alive(), "generate hung after the worker died"
        assert eng._backend.worker.pid != first_worker and eng.manager.restarts == 1
        assert eng.manager.recovered == 1, "the request was not in flight at the kill"
        assert outs[-1]["output_ids"] == expected["output_ids"] and outs[-1]["text"] == expected["text"]


def test_killed_worker_with_no_restarts_fails_requests_and_shutdown_leaves_no_orphans(tiny_dir):
    eng = Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=256, max_restarts=0)
    pids = [p.pid for p in eng._backend.processes]
    result: dict[str, object] = {}

    def long_request():
        try:
            eng.generate("hello", {"max_new_tokens": 1000, "ignore_eos": True})
        except EngineDead as exc:
            result["error"] = exc

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    os.kill(eng._backend.worker.pid, 9)
    t.join(timeout=10)
    assert not t.is_alive(), "generate hung after the worker died"
    assert "worker process died" in str(result["error"])
    with pytest.raises(EngineDead):
        eng.generate("hello", {"max_new_tokens": 1})
    eng.shutdown()
    time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_stopping_the_parent_leaves_no_orphans(tiny_dir, tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(
        "import signal, sys, time\n"
        "from radixserve import Engine\n"
        "if __name__ == '__main__':\n"
        # as an interactive program is: a suite started as a background job passes its children
        # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
        "    signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"    eng = Engine(model={str(tiny_dir)!r}, dtype='float32', kv_pages=64)\n"
        "    print(*[p.pid for p in eng._backend.processes], flush=True)\n"
        # short sleeps: a SIGINT that lands after print's signal check but before a long sleep
        # starts would wait out that sleep (CPython checks pending signals only between bytecodes
        # and on EINTR), which is the interpreter's race, not the engine's
        "    while True:\n"
        "        time.sleep(0.1)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        proc.send_signal(sig)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "scheduler or worker outlived a killed parent"
