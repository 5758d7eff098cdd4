"""Benchmark workloads: prefix-heavy programs (RAG, chat, few-shot, agents) and a control with
no shared prefix, built deterministically from a seed out of real English text
(`pydoc_data.topics`, Python's own documentation).

A workload is a forest of `Node`s. Each node is one request; a root's prompt is its `text`, a
child's prompt is its parent's prompt + the parent's real output + its own `text`:

    root  "system + task\\nThought:"            -> output o1
     |
    child "<root prompt> o1 \\nObservation: ...\\nThought:"   -> output o2
     |
    child "<...> o2 \\nObservation: ...\\nThought:"           ...

So chat turns and agent steps are sequential (a child is sent only once its parent finished),
and a node with several children is a fork (the branches run concurrently). `group` names what
a request shares its prefix with (a document, a conversation, an agent): the load generator
uses it to tell requests whose prefix was already computed when they were sent ("warm") from
those whose prefix was not ("cold").

Sizes are in tokens of the served model's tokenizer (approximate: text is cut at token
boundaries and re-tokenized, which can move a count by a token or two).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pydoc_data.topics import topics
from typing import Any

from bench.corpus import QUESTIONS


@dataclass(frozen=True)
class Node:
    """One request; its prompt is the parent's prompt + the parent's output + `text`.

    A root may also give its prompt as `segments` (their concatenation is `text`): sent as
    radixserve's `segments` on /generate, each piece but the last a reusable segment."""

    text: str
    max_tokens: int
    group: str
    children: tuple[Node, ...] = ()
    segments: tuple[str, ...] = ()

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass(frozen=True)
class Workload:
    name: str
    roots: tuple[Node, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(1 for root in self.roots for _ in root.walk())

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items() if k != "seed")
        return f"{self.name}({args}): {self.num_requests} requests"


# ---------------------------------------------------------------------- text


class TextPool:
    """Chunks of real text, `n` tokens each, handed out in a seeded order and never twice:
    two chunks from one pool share no text (beyond what the documentation repeats itself)."""

    def __init__(self, tokenizer: Any, seed: int, skip_topics: int = 0) -> None:
        self.tokenizer = tokenizer
        names = sorted(topics)
        random.Random(seed).shuffle(names)
        tokenized = _tokenized_topics(tokenizer)
        self._topics = [tokenized[n] for n in names[skip_topics:]]
        self._topic, self._pos = 0, 0

    def take(self, n: int, distinct_start: set[int] | None = None) -> str:
        """The next `n` tokens of text. With `distinct_start`, a chunk whose first token is in
        that set is skipped; the returned chunk's first token is added to it."""
        while self._topic < len(self._topics):
            ids = self._topics[self._topic]
            start = self._pos
            if start + n > len(ids):
                self._topic, self._pos = self._topic + 1, 0
                continue
            self._pos = start + n
            text = self.tokenizer.decode(ids[start : start + n]).strip()
            first = self.tokenizer(text, add_special_tokens=False).input_ids[:1]
            if first and (distinct_start is None or first[0] not in distinct_start):
                if distinct_start is not None:
                    distinct_start.add(first[0])
                return text
        raise ValueError(f"the corpus has no more chunks of {n} tokens; ask for fewer or shorter ones")


_TOKENIZED: dict[tuple[str, int], dict[str, list[int]]] = {}


def _chain(length: int, max_tokens: int, group: str, text: Callable[[int], str]) -> Node:
    """A sequential conversation of `length` requests; `text(i)` is request i's new text.

    Built from the last request up (so `text` is called for length-1 .. 0, the order the
    workloads' seeded draws were defined in); each request waits for the one before it."""
    if length < 1:
        raise ValueError(f"a conversation needs at least one request, got {length}")
    node = Node(text(length - 1), max_tokens, group, ())
    for i in reversed(range(length - 1)):
        node = Node(text(i), max_tokens, group, (node,))
    return node


def _tokenized_topics(tokenizer: Any) -> dict[str, list[int]]:
    """Every topic's token ids, computed once per tokenizer (0.5 s each time otherwise)."""
    key = (str(getattr(tokenizer, "name_or_path", id(tokenizer))), len(tokenizer))
    if key not in _TOKENIZED:
        _TOKENIZED[key] = {n: tokenizer(t, add_special_tokens=False).input_ids for n, t in topics.items()}
    return _TOKENIZED[key]


def _question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS)


# ---------------------------------------------------------------------- workloads


def rag(tokenizer: Any, *, docs: int = 4, doc_tokens: int = 1000, questions: int = 12,
        max_tokens: int = 16, seed: int = 0) -> Workload:
    """D documents of ~L tokens, Q short questions on each; the document is the shared prefix.
    The questions arrive in a seeded random order (documents interleaved)."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    texts = [pool.take(doc_tokens) for _ in range(docs)]
    roots = [
        Node(f"Document:\n{doc}\n\nQuestion: {_question(rng)}\nAnswer:", max_tokens, f"doc{d}")
        for d, doc in enumerate(texts)
        for _ in range(questions)
    ]
    rng.shuffle(roots)
    return Workload("rag", tuple(roots), dict(docs=docs, doc_tokens=doc_tokens, questions=questions,
                                              max_tokens=max_tokens, seed=seed))


def chat(tokenizer: Any, *, conversations: int = 8, turns: int = 6, first_tokens: int = 400,
         turn_tokens: int = 40, max_tokens: int = 16, seed: int = 0) -> Workload:
    """C conversations x T turns; each turn resends the whole history (earlier turns with the
    model's real answers). A conversation opens with a pasted passage of `first_tokens` tokens,
    later user turns carry `turn_tokens` tokens of text."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    roots = []
    for c in range(conversations):
        roots.append(_chain(turns, max_tokens, f"conv{c}", lambda t: (
            f"User: Read this passage.\n{pool.take(first_tokens)}\n{_question(rng)}\nAssistant:" if t == 0
            else f"\nUser: {pool.take(turn_tokens)}\n{_question(rng)}\nAssistant:")))
    return Workload("chat", tuple(roots), dict(conversations=conversations, turns=turns, first_tokens=first_tokens,
                                               turn_tokens=turn_tokens, max_tokens=max_tokens, seed=seed))


def fewshot(tokenizer: Any, *, examples: int = 8, example_tokens: int = 120, questions: int = 48,
            question_tokens: int = 30, max_tokens: int = 16, seed: int = 0) -> Workload:
    """One long few-shot prefix (K examples of ~E tokens) in front of N short questions."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    shots = "".join(
        f"Text: {pool.take(example_tokens)}\nQuestion: {_question(rng)}\nAnswer: {pool.take(12)}\n\n"
        for _ in range(examples)
    )
    prefix = "Answer each question about the text in a few words, as in these examples.\n\n" + shots
    roots = [
        Node(f"{prefix}Text: {pool.take(question_tokens)}\nQuestion: {_question(rng)}\nAnswer:", max_tokens, "shots")
        for _ in range(questions)
    ]
    return Workload("fewshot", tuple(roots), dict(examples=examples, example_tokens=example_tokens, questions=questions,
                                                  question_tokens=question_tokens, max_tokens=max_tokens, seed=seed))


def _agent_preamble(pool: TextPool, tools: int, tool_tokens: int) -> str:
    tool_lines = "".join(f"- tool_{i}(query): {pool.take(tool_tokens)}\n" for i in range(tools))
    return (
        "You are an agent that answers questions about Python. Think step by step. On each step write "
        "'Thought:', then 'Action: tool_name(argument)'; an 'Observation:' follows with the result. "
        "Finish with 'Final Answer:'.\n\nTools:\n" + tool_lines + "\n"
    )


def agent(tokenizer: Any, *, agents: int = 8, steps: int = 5, tools: int = 6, tool_tokens: int = 80,
          observation_tokens: int = 60, max_tokens: int = 24, seed: int = 0) -> Workload:
    """A ReAct loop: a system prompt + tool descriptions shared by every agent, then per agent a
    task and a scratchpad that grows each step with the model's thought/action and an
    observation (text from the corpus)."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    preamble = _agent_preamble(pool, tools, tool_tokens)
    roots = []
    for a in range(agents):
        roots.append(_chain(steps, max_tokens, f"agent{a}", lambda s, a=a: (
            f"{preamble}Task {a}: {_question(rng)} Topic: {pool.take(24)}\nThought:" if s == 0
            else f"\nObservation: {pool.take(observation_tokens)}\nThought:")))
    return Workload("agent", tuple(roots), dict(agents=agents, steps=steps, tools=tools, tool_tokens=tool_tokens,
                                                observation_tokens=observation_tokens, max_tokens=max_tokens, seed=seed))


def agent_fork(tokenizer: Any, *, problems: int = 6, context_tokens: int = 300, branches: int = 4,
               max_tokens: int = 16, seed: int = 0) -> Workload:
    """Fork-style programs: per problem, a plan step, then `branches` concurrent continuations
    of the plan (each exploring one option), then one summary per branch: the problem context
    and the plan are shared by all of a problem's branches."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    preamble = _agent_preamble(pool, 3, 40)
    roots = []
    for p in range(problems):
        branch_nodes = tuple(
            Node(f"\nOption {b + 1}: {_question(rng)}\nReasoning:", max_tokens, f"problem{p}",
                 (Node("\nSo, in one sentence:", max_tokens, f"problem{p}"),))
            for b in range(branches)
        )
        text = f"{preamble}Problem {p}:\n{pool.take(context_tokens)}\nPlan:"
        roots.append(Node(text, max_tokens, f"problem{p}", branch_nodes))
    return Workload("agent_fork", tuple(roots), dict(problems=problems, context_tokens=context_tokens,
                                                     branches=branches, max_tokens=max_tokens, seed=seed))


def unique(tokenizer: Any, *, requests: int = 24, prompt_tokens: int = 400, max_tokens: int = 16,
           seed: int = 0) -> Workload:
    """N prompts that share no prefix at all (not even a first token): the cache cannot help."""
    pool = TextPool(tokenizer, seed)
    firsts: set[int] = set()
    roots = [Node(pool.take(prompt_tokens, distinct_start=firsts), max_tokens, f"u{i}") for i in range(requests)]
    return Workload("unique", tuple(roots), dict(requests=requests, prompt_tokens=prompt_tokens,
                                                 max_tokens=max_tokens, seed=seed))


def quote(tokenizer: Any, *, docs: int = 4, doc_tokens: int = 600, questions: int = 4, max_tokens: int = 64,
          seed: int = 0) -> Workload:
    """D documents of ~L tokens, Q requests on each to copy a passage of the document word for
    word, from the start of one of its sentences: answers that quote their prompt, which is what
    speculative decoding by prompt lookup is for. Seeded random order."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    roots = []
    for d in range(docs):
        doc = pool.take(doc_tokens)
        sentences = [s for s in re.split(r"(?<=[.!?:])\s+", doc) if len(s.split()) >= 8] or [doc]
        for _ in range(questions):
            start = re.match(r"\S+(?:\s+\S+){5}", rng.choice(sentences)).group(0)  # as the document has it
            text = (f"Document:\n{doc}\n\nCopy the passage of the document that begins with \"{start}\", word "
                    f"for word:\n{start}")
            roots.append(Node(text, max_tokens, f"quote{d}"))
    rng.shuffle(roots)
    return Workload("quote", tuple(roots), dict(docs=docs, doc_tokens=doc_tokens, questions=questions,
                                                max_tokens=max_tokens, seed=seed))


RAG_INSTRUCTION = "Answer the question from the documents below.\n\n"


def rag_multi(tokenizer: Any, *, chunks: int = 16, chunk_tokens: int = 350, questions: int = 48, top_k: int = 3,
              max_tokens: int = 16, seed: int = 0) -> Workload:
    """Retrieval as RAG pipelines do it: Q questions, each with its top K of C shared chunks of ~L
    tokens, in that question's own relevance order (a seeded draw), after one instruction. The
    same chunks come back again and again, almost never after the same predecessors, so a
    prefix cache reuses little beyond the instruction. Each prompt is also given as segments
    (instruction, the K chunks, the question) for radixserve's segment cache."""
    rng = random.Random(seed)
    pool = TextPool(tokenizer, seed)
    texts = [pool.take(chunk_tokens) for _ in range(chunks)]
    roots = []
    for q in range(questions):
        picked = rng.sample(range(chunks), top_k)
        pieces = (RAG_INSTRUCTION, *(f"Document:\n{texts[c]}\n\n" for c in picked),
                  f"Question: {_question(rng)}\nAnswer:")
        roots.append(Node("".join(pieces), max_tokens, f"q{q}", segments=pieces))
    return Workload("rag_multi", tuple(roots), dict(chunks=chunks, chunk_tokens=chunk_tokens, questions=questions,
                                                    top_k=top_k, max_tokens=max_tokens, seed=seed))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "rag": rag, "chat": chat, "fewshot": fewshot, "agent": agent, "agent_fork": agent_fork, "unique": unique,
    "quote": quote, "rag_multi": rag_multi,
}


def build(name: str, tokenizer: Any, **sizes: Any) -> Workload:
    """`WORKLOADS[name]` with the given sizes (unknown names are errors)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](tokenizer, **sizes)
