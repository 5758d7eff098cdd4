"""The benchmark workloads: deterministic from a seed, sizes honoured, prefixes shared where
they should be and nowhere else."""

from __future__ import annotations

import pytest

from bench.workloads import WORKLOADS, Node, Workload, build


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _flat(w: Workload) -> list[tuple[str, int, str]]:
    return [(n.text, n.max_tokens, n.group) for r in w.roots for n in r.walk()]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_deterministic_from_seed(tokenizer, name):
    assert _flat(build(name, tokenizer, seed=3)) == _flat(build(name, tokenizer, seed=3))
    assert _flat(build(name, tokenizer, seed=3)) != _flat(build(name, tokenizer, seed=4))


def test_rag_sizes_and_shared_documents(tokenizer):
    w = build("rag", tokenizer, docs=3, doc_tokens=200, questions=4, max_tokens=7, seed=1)
    assert w.num_requests == 12 and all(not r.children and r.max_tokens == 7 for r in w.roots)
    by_doc: dict[str, list[list[int]]] = {}
    for r in w.roots:
        by_doc.setdefault(r.group, []).append(ids(tokenizer, r.text))
    assert sorted(len(v) for v in by_doc.values()) == [4, 4, 4]
    groups = list(by_doc.values())
    for prompts in groups:  # the document (~200 tokens after "Document:\n") is shared exactly
        assert all(common_prefix(prompts[0], p) >= 200 for p in prompts[1:])
    assert common_prefix(groups[0][0], groups[1][0]) < 10  # different documents differ early
    assert len({r.group for r in w.roots[:3]}) > 1, "questions arrive interleaved across documents"


def test_chat_turns_chain_and_sizes(tokenizer):
    w = build("chat", tokenizer, conversations=3, turns=4, first_tokens=100, turn_tokens=20, seed=0)
    assert len(w.roots) == 3 and w.num_requests == 12
    for root in w.roots:
        chain = list(root.walk())
        assert len(chain) == 4 and all(len(n.children) == (1 if i < 3 else 0) for i, n in enumerate(chain))
        assert 100 <= len(ids(tokenizer, chain[0].text)) <= 140
        assert all(n.text.startswith("\nUser: ") and n.text.endswith("Assistant:") for n in chain[1:])
        assert len({n.group for n in chain}) == 1


def test_fewshot_one_shared_prefix(tokenizer):
    w = build("fewshot", tokenizer, examples=3, example_tokens=50, questions=5, question_tokens=10, seed=0)
    prompts = [ids(tokenizer, r.text) for r in w.roots]
    assert len(prompts) == 5
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared >= 3 * 50 and all(len(p) - shared < 40 for p in prompts)


def test_agent_shares_preamble_and_grows_scratchpads(tokenizer):
    w = build("agent", tokenizer, agents=3, steps=3, tools=2, tool_tokens=30, observation_tokens=15, seed=0)
    assert w.num_requests == 9
    roots = [ids(tokenizer, r.text) for r in w.roots]
    assert common_prefix(roots[0], roots[1]) >= 60  # system prompt + tool descriptions
    for root in w.roots:
        steps = list(root.walk())
        assert [n.text.startswith("\nObservation: ") for n in steps] == [False, True, True]


def test_agent_fork_branches(tokenizer):
    w = build("agent_fork", tokenizer, problems=2, context_tokens=50, branches=3, seed=0)
    assert w.num_requests == 2 * (1 + 3 + 3)
    assert all(len(r.children) == 3 and all(len(c.children) == 1 for c in r.children) for r in w.roots)


def test_unique_prompts_share_nothing(tokenizer):
    w = build("unique", tokenizer, requests=20, prompt_tokens=60, seed=0)
    prompts = [ids(tokenizer, r.text) for r in w.roots]
    assert len(prompts) == 20 and all(55 <= len(p) <= 65 for p in prompts)
    bos = int(bool(prompts[0]) and prompts[0][0] == tokenizer.bos_token_id)
    assert all(common_prefix(a, b) <= bos for i, a in enumerate(prompts) for b in prompts[i + 1 :])


def test_unknown_workload_and_sizes_rejected(tokenizer):
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", tokenizer)
    with pytest.raises(TypeError):
        build("rag", tokenizer, bogus=1)


def test_node_walk_order():
    leaf = Node("c", 1, "g")
    root = Node("a", 1, "g", (Node("b", 1, "g", (leaf,)), Node("d", 1, "g")))
    assert [n.text for n in root.walk()] == ["a", "b", "c", "d"]


def test_quote_asks_to_copy_a_passage_that_stands_in_its_document(tokenizer):
    w = build("quote", tokenizer, docs=2, doc_tokens=200, questions=3, max_tokens=32)
    assert w.num_requests == 6 and {n.group for n in w.roots} == {"quote0", "quote1"}
    for node in w.roots:
        doc, ask = node.text.split("\n\nCopy the passage of the document that begins with ")
        start = ask.split('"')[1]
        assert start in doc and node.text.endswith(start) and node.max_tokens == 32
