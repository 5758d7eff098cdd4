"""frontend_lang against a real radixserve server (a subprocess on a free loopback port) through
`fl.RuntimeEndpoint`, with an API key.

The language tests of test_frontend_lang.py run here again, imported below, with this module's
fixtures: the backend is the HTTP endpoint and the oracle is a plain httpx POST /generate. The
examples run against the same server; the default model's outputs are checked once (slow).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import Server, free_port
from test_frontend_lang import (  # noqa: F401 - collected again, here against the server
    PAGE_SIZE,
    chat,
    test_async_programs,
    test_errors_from_the_runtime_are_exceptions_with_its_message,
    test_fork_sends_the_prefix_once_and_every_branch_hits_it,
    test_forks_and_segments_at_the_edges,
    test_gen_at_temperature_0_equals_generate,
    test_gen_with_a_regex_or_a_json_schema_is_constrained,
    test_n_samples_inside_a_program,
    test_programs_without_segments_send_text_as_before,
    test_roles_render_with_the_models_chat_template,
    test_run_batch_keeps_order_and_a_failure_loses_nothing_else,
    test_run_batch_of_16_questions_over_one_document_is_mostly_cached,
    test_segments_are_sent_as_segments_and_only_their_texts_are_reusable,
    test_select_picks_what_scoring_each_choice_separately_picks,
    test_streaming_yields_the_gen_as_it_arrives,
)

import frontend_lang as fl
from radixserve.tokenizer import load_tokenizer

API_KEY = "frontend-lang-test-key"
OPTIONS = ("--dtype", "float32", "--page-size", str(PAGE_SIZE), "--kv-pages", "4096", "--api-key", API_KEY)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *OPTIONS)


@pytest.fixture(scope="module")
def backend(server):
    with fl.RuntimeEndpoint(server.url, api_key=API_KEY) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def raw(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oracle(raw) -> Callable[[dict[str, Any]], Any]:
    def call(request: dict[str, Any]) -> Any:
        response = raw.post("/generate", json=request)
        assert response.status_code == 200, response.text
        return response.json()

    return call


@pytest.fixture(scope="module")
def bad_request_message(raw) -> str:
    response = raw.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}})
    assert response.status_code == 400
    return response.json()["error"]["message"]


# ---------------------------------------------------------------------- the endpoint itself


def test_api_key_and_unreachable_server_are_clear_errors(server):
    with fl.RuntimeEndpoint(server.url) as no_key, pytest.raises(fl.BackendError) as info:
        chat.run(question="hi", backend=no_key)
    assert info.value.status == 401 and "API key" in info.value.message
    with fl.RuntimeEndpoint(f"http://127.0.0.1:{free_port()}") as nobody, pytest.raises(fl.BackendError, match="failed"):
        chat.run(question="hi", backend=nobody)


def test_chat_template_from_the_server_or_given(backend, tokenizer, server):
    assert backend.chat_template == fl.ChatTemplate.from_tokenizer(tokenizer)
    given = fl.ChatTemplate.chatml()  # no default system prompt
    with fl.RuntimeEndpoint(server.url, api_key=API_KEY, chat_template=given) as endpoint:
        state = chat.run(question="hi", backend=endpoint, max_tokens=1)
    assert state.text().startswith("<|im_start|>system\nYou answer in a few words.<|im_end|>\n")
    with fl.RuntimeEndpoint(server.url, api_key=API_KEY, chat_template="/nonexistent/model") as endpoint:
        with pytest.raises(ValueError, match="not on this machine"):
            chat.run(question="hi", backend=endpoint)


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"fl_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_examples_run_against_a_server(server, capsys):
    key = ["--url", server.url, "--api-key", API_KEY]
    react = _example("react_agent")
    assert react.calculator("17 * 23 + 4") == "395" and react.calculator("__import__('os')").startswith("error")
    state = react.main(["What is 2 + 2?", "--max-steps", "2", *key])
    assert state.error is None and state.cache_stats().hit_rate > 0.5
    states = _example("rag").main(["--questions", "4", "--doc-chars", "1500", "--max-tokens", "4", *key])
    assert all(s.error is None for s in states)
    state = _example("tree_of_thought").main(["--breadth", "2", "--depth", "2", *key])
    assert len(state["tree"]) == 2 and all(len(level) == 2 for level in state["tree"])
    out = capsys.readouterr().out
    assert out.count("cache: ") == 3


# ---------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model_gen_equals_generate(tmp_path):
    """SmolLM2-135M in fp32: a chat turn generated by a program is what /generate gives for the
    same rendered text, and select answers a question a small model knows."""
    srv = Server("default", "--dtype", "float32", "--api-key", API_KEY, log_path=tmp_path / "server.log")
    try:
        srv.wait_healthy()
        with fl.RuntimeEndpoint(srv.url, api_key=API_KEY) as endpoint:
            state = chat.run(question="What is the capital of France?", backend=endpoint, max_tokens=12)
        messages = state.messages()
        prompt = endpoint.chat_template.begin("system", True) + messages[0]["content"] + "<|im_end|>\n"
        prompt += f"<|im_start|>user\n{messages[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
        response = httpx.post(
            srv.url + "/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
            json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
        )
        assert state["answer"] == response.json()["text"]
        assert "Paris" in state["answer"]
    finally:
        assert srv.stop() == 0, srv.log()
