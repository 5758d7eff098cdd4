"""frontend_lang on an in-process Engine (the tiny random Llama with the real SmolLM2 tokenizer
and chat template).

The tests taking `backend` and `oracle` also run against a real HTTP server: the server module
imports them and supplies its own fixtures (test_frontend_lang_server.py). `oracle` is the
runtime's own /generate call, bypassing frontend_lang, for "the same as doing it by hand".
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest

import frontend_lang as fl
from radixserve import Engine
from radixserve.front.types import InvalidRequest

PAGE_SIZE = 16
GREEDY = {"temperature": 0.0}


def long_document(tokenizer: Any, num_tokens: int = 1000) -> str:
    """About `num_tokens` tokens of Python's own documentation (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    text = max(topics.values(), key=len)
    return tokenizer.decode(tokenizer(text).input_ids[:num_tokens])


# ---------------------------------------------------------------------- fixtures (engine)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with Engine(model=str(tiny_dir), dtype="float32", page_size=PAGE_SIZE, kv_pages=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def backend(engine):
    return fl.EngineBackend(engine)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def oracle(engine) -> Callable[[dict[str, Any]], Any]:
    """A /generate call straight to the engine; raises the runtime's own exceptions."""

    def call(request: dict[str, Any]) -> Any:
        request = dict(request)
        return engine.generate(request.pop("text", None), **request)

    return call


@pytest.fixture(scope="module")
def bad_request_message(oracle) -> str:
    """What the runtime says, by hand, to a gen with temperature -1."""
    with pytest.raises(InvalidRequest) as info:
        oracle({"text": "hi", "sampling_params": {"temperature": -1}})
    return info.value.message


# ---------------------------------------------------------------------- programs used below


@fl.function
def chat(s, question, max_tokens=8):
    s += fl.system("You answer in a few words.")
    s += fl.user(question)
    s += fl.assistant(fl.gen("answer", max_tokens=max_tokens, **GREEDY))


@fl.function
def ask_document(s, doc, question):
    s += fl.user(f"{doc}\n\nQuestion: {question}")
    s += fl.assistant(fl.gen("answer", max_tokens=4, **GREEDY))


# ---------------------------------------------------------------------- shared with the server tests


def test_gen_at_temperature_0_equals_generate(backend, oracle):
    @fl.function
    def complete(s, prompt):
        s += prompt
        s += fl.gen("out", max_tokens=12, temperature=0)
        s += " and then"
        s += fl.gen("more", max_tokens=6, temperature=0)

    prompt = "The quick brown fox jumps over the lazy dog because"
    state = complete.run(prompt=prompt, backend=backend)
    first = oracle({"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 12}})
    assert state["out"] == first["text"]
    second = oracle({"text": prompt + first["text"] + " and then", "sampling_params": {**GREEDY, "max_new_tokens": 6}})
    assert state["more"] == second["text"]
    assert state.text() == prompt + first["text"] + " and then" + second["text"]
    assert state.meta_info("out")["completion_tokens"] == 12
    # the second call extends the first call's prompt: its prefix comes from the cache
    assert state.meta_info("more")["cached_tokens"] >= len(backend_tokens(oracle, prompt)) // PAGE_SIZE * PAGE_SIZE
    assert state.cache_stats().calls == 2


def test_gen_with_a_regex_or_a_json_schema_is_constrained(backend):
    """sgl.gen(regex=...) and json_schema=...: the tiny model's noise, made to fit."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}

    @fl.function
    def plan(s):
        s += "Trip code: "
        s += fl.gen("code", max_tokens=16, temperature=0.8, seed=1, regex=r"[A-Z]{2}-[0-9]{3}")
        s += "\nPlan: "
        s += fl.gen("plan", max_tokens=48, temperature=0.8, seed=2, json_schema=schema)

    state = plan.run(backend=backend)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", state["code"]), state["code"]
    parsed = json.loads(state["plan"])
    assert parsed["city"] in ("Paris", "Rome") and 1 <= parsed["days"] <= 9, parsed
    assert state.text() == f"Trip code: {state['code']}\nPlan: {state['plan']}"


def backend_tokens(oracle: Callable[[dict[str, Any]], Any], text: str) -> list[int]:
    """The runtime's tokenization of `text`."""
    out = oracle({"text": text, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0})
    return [t for _, t, _ in out["meta_info"]["input_token_logprobs"]]


def test_roles_render_with_the_models_chat_template(backend, oracle, tokenizer):
    state = chat.run(question="What colour is the sky?", backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[2]["content"] == state["answer"]
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    # the generated turn is what /generate gives after the template's generation prompt
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert state["answer"] == oracle({"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 8}})["text"]

    @fl.function
    def no_system(s):
        with s.user():
            s += "Hi"
            s += " there"
        s += fl.assistant("Hello!")

    state = no_system.run(backend=backend)
    expected = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert state.messages() == expected
    # the template's default system prompt comes first, as the template writes it
    assert state.text() == tokenizer.apply_chat_template(expected, tokenize=False)


def separate_scores(oracle, tokenizer, prompt: str, choices: list[str]) -> list[tuple[list[int], float]]:
    """Each choice scored on its own, from scratch: (its tokens after the prompt, logprob sum)."""
    prompt_ids = tokenizer(prompt).input_ids
    out = []
    for choice in choices:
        res = oracle({
            "text": prompt + choice, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0,
        })
        entries = res["meta_info"]["input_token_logprobs"]
        ids = [t for _, t, _ in entries]
        same = next(i for i, (a, b) in enumerate(zip(ids, prompt_ids + [None])) if a != b)
        out.append((ids[same:], sum(lp for lp, _, _ in entries[same:])))
    return out


@pytest.mark.parametrize("prompt", ["Is the sky blue? Answer:", "Is the sky blue? The answer is "])
def test_select_picks_what_scoring_each_choice_separately_picks(backend, oracle, tokenizer, prompt):
    choices = ["yes", "no", " maybe so", "absolutely not, never"]

    @fl.function
    def pick(s, prompt, normalize):
        s += prompt
        s += fl.select("pick", choices=choices, normalize=normalize)

    state = pick.run(prompt=prompt, normalize=True, backend=backend)
    scores = state.meta_info("pick")["scores"]
    expected = separate_scores(oracle, tokenizer, prompt, choices)
    for score, (ids, total) in zip(scores, expected):
        assert list(score.token_ids) == ids
        assert score.logprob_sum == pytest.approx(total, abs=1e-3)
        assert score.normalized == pytest.approx(total / len(ids), abs=1e-3)
    by_mean = max(range(len(choices)), key=lambda i: expected[i][1] / len(expected[i][0]))
    by_sum = max(range(len(choices)), key=lambda i: expected[i][1])
    assert state["pick"] == choices[by_mean]
    assert state.text() == prompt + choices[by_mean]
    assert pick.run(prompt=prompt, normalize=False, backend=backend)["pick"] == choices[by_sum]
    if prompt.endswith(" "):
        # BPE merges the prompt's trailing space into the choice: " yes" is one token, so the
        # choice is scored from that token on, not from a lone " " the prompt ends with
        assert scores[0].token_ids == tuple(tokenizer(prompt + "yes").input_ids[len(tokenizer(prompt).input_ids) - 1 :])
        assert scores[0].num_tokens == 1


def test_fork_sends_the_prefix_once_and_every_branch_hits_it(backend, tokenizer):
    doc = long_document(tokenizer)
    prefix = f"{doc}\n\nThree short ideas about the text above:\n"

    @fl.function
    def ideas(s):
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i + 1}."
            f += fl.gen("idea", max_tokens=4, temperature=0)
        s["ideas"] = forks["idea"]

    state = ideas.run(backend=backend)
    prefix_tokens = len(tokenizer(prefix).input_ids)
    assert prefix_tokens > 900
    branches = state.forks[0]
    cached = [b.meta_info("idea")["cached_tokens"] for b in branches]
    whole = prefix_tokens // PAGE_SIZE * PAGE_SIZE  # every full page of the prefix
    print(f"fork: prefix {prefix_tokens} tokens, branches cached {cached}")
    assert sum(c >= whole for c in cached) >= 2, cached
    assert all(c >= whole for c in cached), cached
    assert state["ideas"] == branches["idea"] == [b["idea"] for b in branches]
    assert [b.text() for b in branches] == [prefix + f"{i + 1}." + branches[i]["idea"] for i in range(3)]
    assert [c.kind for c in state.calls()].count("fork") == 1


def test_run_batch_of_16_questions_over_one_document_is_mostly_cached(backend, tokenizer):
    doc = long_document(tokenizer)
    questions = [f"What does part {i} of the text say about {w}?" for i, w in enumerate("abcdefghijklmnop")]
    states = ask_document.run_batch([{"doc": doc, "question": q} for q in questions], backend=backend, num_threads=16)
    assert all(s.error is None for s in states)
    stats = sum((s.cache_stats() for s in states), fl.CacheStats())
    print(f"run_batch: {stats}")
    assert stats.calls == 16 and stats.prompt_tokens > 16 * 1000
    assert stats.hit_rate >= 0.8, stats
    # in order: each state answers its own question
    assert [s.messages()[0]["content"].endswith(q) for s, q in zip(states, questions)] == [True] * 16


def test_run_batch_keeps_order_and_a_failure_loses_nothing_else(backend, bad_request_message):
    @fl.function
    def echo(s, word, temperature=0.0):
        s += f"Say {word}:"
        s += fl.gen("out", max_tokens=3, temperature=temperature)
        return word

    args = [{"word": w} for w in ["alpha", "beta", "gamma", "delta"]]
    args[2]["temperature"] = -1.0
    states = echo.run_batch(args, backend=backend, num_threads=2, progress_bar=True)
    assert [s.return_value for s in states] == ["alpha", "beta", None, "delta"]
    assert [s.error is None for s in states] == [True, True, False, True]
    assert isinstance(states[2].error, fl.BackendError)
    assert states[2].error.message == bad_request_message
    with pytest.raises(fl.BackendError):
        states[2]["out"]
    assert all(isinstance(states[i]["out"], str) for i in (0, 1, 3))


def test_errors_from_the_runtime_are_exceptions_with_its_message(backend, bad_request_message):
    with pytest.raises(fl.BackendError) as info:
        chat.run(question="hi", max_tokens=10**7, backend=backend)
    assert info.value.status == 400 and "max_new_tokens" in info.value.message

    @fl.function
    def bad(s):
        s += "hi"
        s += fl.gen("x", temperature=-1)

    with pytest.raises(fl.BackendError) as info:
        bad.run(backend=backend)
    assert info.value.message == bad_request_message and info.value.status == 400
    streamed = bad.run(backend=backend, stream=True)
    with pytest.raises(fl.BackendError, match="temperature"):
        list(streamed.text_iter("x"))
    assert isinstance(streamed.error, fl.BackendError)


def test_streaming_yields_the_gen_as_it_arrives(backend):
    @fl.function
    def story(s):
        s += "Once upon a time"
        s += fl.gen("story", max_tokens=16, temperature=0, ignore_eos=True)
        s += "."

    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["story"] == story.run(backend=backend)["story"]
    assert "".join(state.text_iter()) == state.text() == "Once upon a time" + state["story"] + "."
    assert state.meta_info("story")["completion_tokens"] == 16


def test_n_samples_inside_a_program(backend):
    @fl.function
    def samples(s):
        s += "Name a colour:"
        s += fl.gen("colours", n=3, max_tokens=4, temperature=1.0, seed=7)
        forks = s.fork(3)
        for f, c in zip(forks, s["colours"]):
            f += c + " is nice because"
            f += fl.gen("why", max_tokens=3, temperature=0)
        return forks["why"]

    state = samples.run(backend=backend)
    assert len(state["colours"]) == 3 and all(isinstance(c, str) for c in state["colours"])
    assert state.text() == "Name a colour:"  # n > 1 appends nothing
    assert len(state.meta_info("colours")) == 3
    assert len(state.return_value) == 3
    assert samples.run(backend=backend)["colours"] == state["colours"]  # the seed reproduces

    @fl.function
    def in_a_turn(s):
        s += fl.user("hi")
        s += fl.assistant(fl.gen("x", n=2))

    with pytest.raises(ValueError, match="n > 1 inside the assistant block"):
        in_a_turn.run(backend=backend)


def test_async_programs(backend):
    questions = ["Why?", "How?", "When?"]

    async def main() -> tuple[list[fl.ProgramState], list[fl.ProgramState]]:
        one_by_one = await asyncio.gather(*(chat.run_async(question=q, backend=backend) for q in questions))
        batch = await chat.run_batch_async([{"question": q} for q in questions], backend=backend)
        return list(one_by_one), batch

    one_by_one, batch = asyncio.run(main())
    expected = [chat.run(question=q, backend=backend)["answer"] for q in questions]
    assert [s["answer"] for s in one_by_one] == expected == [s["answer"] for s in batch]


# ---------------------------------------------------------------------- engine only


def test_chat_template_derived_from_the_tokenizer(tokenizer):
    template = fl.ChatTemplate.from_tokenizer(tokenizer)
    assert template.prefix == {r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
    assert template.suffix == {r: "<|im_end|>\n" for r in ("system", "user", "assistant")}
    assert template.begin("user", first_block=True).startswith("<|im_start|>system\nYou are a helpful")
    assert template.begin("system", first_block=True) == "<|im_start|>system\n"
    assert fl.ChatTemplate.chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face") == template


def test_a_non_incremental_template_is_refused(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ messages | length }}"
    with pytest.raises(ValueError, match="incrementally"):
        fl.ChatTemplate.from_tokenizer(tok)


def test_a_bos_the_tokenizer_adds_is_not_written_twice(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    assert fl.ChatTemplate.from_tokenizer(tok).begin("user", True) == tok.bos_token + "[user]"

    class AddsBos:  # a Llama-style tokenizer: encoding puts BOS in front by itself
        chat_template = tok.chat_template
        bos_token, bos_token_id = tok.bos_token, tok.bos_token_id

        def __call__(self, text):
            return type("Enc", (), {"input_ids": [self.bos_token_id, *tok(text).input_ids]})

        def apply_chat_template(self, *args, **kwargs):
            return tok.apply_chat_template(*args, **kwargs)

    assert fl.ChatTemplate.from_tokenizer(AddsBos()).begin("user", True) == "[user]"


def test_a_template_without_a_system_role(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}"
    )
    template = fl.ChatTemplate.from_tokenizer(tok)
    assert template.begin("user", True) == "<turn>user\n" and template.end("assistant") == "</turn>\n"
    with pytest.raises(ValueError, match="no 'system' role"):
        template.begin("system", True)


def test_mistakes_in_programs_are_clear_errors(backend):
    with pytest.raises(TypeError, match="cannot add a int"):
        chat.run(question=3, backend=backend)
    with pytest.raises(ValueError, match="non-empty list of choices"):
        fl.select("x", choices=[])

    @fl.function
    def nested(s):
        s += fl.user("a", fl.assistant("b"))

    with pytest.raises(ValueError, match="cannot start inside the open user block"):
        nested.run(backend=backend)

    @fl.function
    def raises(s):
        s += "text"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        raises.run(backend=backend)
    assert raises.run_batch([{}], backend=backend)[0].error.args == ("boom",)
    with pytest.raises(KeyError, match="no variable 'missing'"):
        chat.run(question="hi", backend=backend)["missing"]


def test_default_backend_and_inline_subprograms(backend):
    @fl.function
    def greet(s, name):
        s += f"Hello {name}."

    @fl.function
    def twice(s):
        greet(s, "Ada")
        greet(s, "Alan")

    fl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        twice.run()
    fl.set_default_backend(backend)
    try:
        assert twice.run().text() == "Hello Ada.Hello Alan."
    finally:
        fl.set_default_backend(None)


def test_forks_run_concurrently(backend):
    """All branches' calls are in flight together, not one after another."""
    in_flight, peak, lock = [0], [0], threading.Lock()

    class Counting(fl.EngineBackend):
        def generate(self, request):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            try:
                return super().generate(request)
            finally:
                with lock:
                    in_flight[0] -= 1

    @fl.function
    def fan_out(s):
        s += "Four words:"
        forks = s.fork(4)
        forks += fl.gen("w", max_tokens=24, temperature=0, ignore_eos=True)
        return forks.join()["w"]

    state = fan_out.run(backend=Counting(backend.engine))
    assert len(state.return_value) == 4 and peak[0] >= 2


class Recording(fl.Backend):
    """A backend that passes every call on to `inner` and keeps the requests it sent."""

    def __init__(self, inner: fl.Backend) -> None:
        self.inner = inner
        self.requests: list[dict[str, Any]] = []

    def generate(self, request: dict[str, Any]) -> Any:
        self.requests.append(request)
        return self.inner.generate(request)

    def generate_stream(self, request: dict[str, Any]) -> Any:
        self.requests.append(request)
        return self.inner.generate_stream(request)

    @property
    def chat_template(self) -> fl.ChatTemplate:
        return self.inner.chat_template


@fl.function
def rag(s, docs, question):
    s += fl.system("Answer from the documents.")
    with s.user():
        for i, doc in enumerate(docs):
            s += f"Document {i + 1}:\n"
            s += fl.segment(doc)
        s += f"Question: {question}"
    s += fl.assistant(fl.gen("answer", max_tokens=4, **GREEDY))


def test_segments_are_sent_as_segments_and_only_their_texts_are_reusable(backend, oracle, tokenizer):
    docs = ["The Loire is the longest river in France.\n", "The Seine flows through Paris.\n"]
    recording = Recording(backend)
    state = rag.run(docs=docs, question="Which river flows through Paris?", backend=recording)
    (request,) = recording.requests
    assert "text" not in request
    pieces, reuse = request["segments"], request["segment_reuse"]
    prompt = state.text()[: -len(state["answer"]) - len(backend.chat_template.end("assistant"))]
    assert "".join(pieces) == prompt
    assert [p for p, r in zip(pieces, reuse, strict=True) if r] == docs  # the documents, nothing else
    assert pieces[1] == docs[0] and pieces[2] == "Document 2:\n" and not reuse[2] and not reuse[-1]
    meta = state.meta_info("answer")
    assert {"segment_tokens", "recomputed_tokens"} <= set(meta)
    assert 0 <= meta["recomputed_tokens"] <= meta["segment_tokens"] <= meta["cached_tokens"]
    # the runtime's own answer to the same segments: the same prompt, token for token
    by_hand = oracle({**request, "sampling_params": {"max_new_tokens": 0}})
    assert by_hand["meta_info"]["prompt_tokens"] == meta["prompt_tokens"]
    ids = tokenizer(pieces[0]).input_ids + [t for p in pieces[1:] for t in tokenizer(p, add_special_tokens=False).input_ids]
    assert meta["prompt_tokens"] == len(ids)


def test_programs_without_segments_send_text_as_before(backend):
    recording = Recording(backend)
    state = chat.run(question="Is water wet?", backend=recording)
    assert state["answer"] is not None
    assert all("segments" not in r and "segment_reuse" not in r and isinstance(r["text"], str) for r in recording.requests)


def test_forks_and_segments_at_the_edges(backend):
    assert fl.document is fl.segment
    with pytest.raises(ValueError, match="fl.segment needs a non-empty string"):
        fl.segment("")

    @fl.function
    def edges(s):
        s += fl.segment("A first document.\n")
        s += fl.segment("A second document.\n")
        branches = s.fork(2)
        for i, b in enumerate(branches):
            b += f"Question {i}: why?"
            b += fl.gen("answer", max_tokens=2, **GREEDY)
        branches.join()
        s += fl.segment("A last document.")
        s += fl.gen("tail", max_tokens=2, **GREEDY)

    recording = Recording(backend)
    edges.run(backend=recording)
    fork_call, *gens = recording.requests
    # the fork's prefix ends with a segment: the last piece is computed in context
    assert fork_call["segments"] == ["A first document.\n", "A second document.\n"]
    assert fork_call["segment_reuse"] == [True, False]
    for branch in gens[:2]:
        assert branch["segments"][-1] in ("Question 0: why?", "Question 1: why?")
        assert branch["segment_reuse"] == [True, True, False], branch
    assert gens[2]["segments"][-1] == "A last document." and gens[2]["segment_reuse"][-1] is False
