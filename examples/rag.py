"""RAG: retrieve documents once, then ask many questions of them in one `run_batch`.

    make serve                                   # in another terminal
    python examples/rag.py --query "for loop statement" --questions 16

The documents are Python's own reference topics (`pydoc_data.topics`), retrieved by a small
keyword score. Every question's prompt starts with the same system turn and the same documents,
so after the first the server computes only the question: the cache hit rate printed at the
end is measured from the server's `cached_tokens`, not assumed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import Counter

import frontend_lang as fl

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


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z_]+", text.lower())


def retrieve(query: str, k: int, max_chars: int) -> list[str]:
    """The k reference topics that best match `query` (tf-idf over words), cut to `max_chars`."""
    from pydoc_data.topics import topics

    docs = {name: Counter(_words(text)) for name, text in topics.items()}
    df = Counter(w for counts in docs.values() for w in counts)

    def score(name: str) -> float:
        counts = docs[name]
        return sum(math.log(1 + counts[w]) * math.log(len(docs) / df[w]) for w in _words(query) if w in counts)

    best = sorted(docs, key=score, reverse=True)[:k]
    return [topics[name][:max_chars].strip() for name in best]


@fl.function
def answer(s, documents: list[str], question: str) -> None:
    s += fl.system("Answer the question using only the documents. Be brief.")
    context = "\n\n".join(f"[{i + 1}] {doc}" for i, doc in enumerate(documents))
    s += fl.user(f"Documents:\n{context}\n\nQuestion: {question}")
    s += fl.assistant(fl.gen("answer", max_tokens=64))


def main(argv: list[str] | None = None) -> list[fl.ProgramState]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--query", default="for loop statement")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--doc-chars", type=int, default=2500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a radixserve server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    args = parser.parse_args(argv)

    documents = retrieve(args.query, args.documents, args.doc_chars)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.questions)]
    with fl.RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        states = answer.run_batch(
            [{"documents": documents, "question": q} for q in questions], backend=backend,
            progress_bar=True, default_sampling={"temperature": 0, "max_tokens": args.max_tokens},
        )
    for question, state in zip(questions, states):
        reply = f"error: {state.error}" if state.error else state["answer"].strip()
        print(f"Q: {question}\nA: {reply}\n")
    print(f"cache: {sum((s.cache_stats() for s in states), fl.CacheStats())}")
    return states


if __name__ == "__main__":
    main()
