"""Real English text for benchmarks: Python's own documentation topics (`pydoc_data.topics`)."""

from __future__ import annotations

from pydoc_data.topics import topics
from typing import Any

QUESTIONS = [
    "What is this section about?",
    "Summarize the main rule in one sentence.",
    "Give one example from the text.",
    "Which keyword matters most here?",
    "What would a beginner get wrong?",
    "Name one exception mentioned.",
    "How does this relate to functions?",
    "What is the default behaviour?",
    "List two terms defined here.",
    "Is anything deprecated?",
    "What does the first paragraph say?",
    "Explain it to a child.",
    "What changed across Python versions?",
    "Which method is called implicitly?",
    "What is the return value?",
    "Quote the most important sentence.",
]


def documents(tokenizer: Any, count: int, num_tokens: int, skip: int = 0) -> list[str]:
    """`count` distinct documents of about `num_tokens` tokens each, longest topics first."""
    names = sorted(topics, key=lambda k: -len(topics[k]))[skip:]
    docs = []
    for name in names:
        ids = tokenizer(topics[name]).input_ids
        if len(ids) >= num_tokens:
            docs.append(tokenizer.decode(ids[1 : num_tokens + 1] if ids[0] == tokenizer.bos_token_id else ids[:num_tokens]))
        if len(docs) == count:
            return docs
    raise ValueError(f"only {len(docs)} topics have {num_tokens} tokens; ask for fewer or shorter documents")


def question(i: int) -> str:
    return QUESTIONS[i % len(QUESTIONS)]
