"""RAG with segments: each question retrieves its own top documents, in its own order, and the
server reuses every document's KV wherever it sits (docs/cache.md, "Segments").

    make serve                                   # in another terminal
    python examples/rag_segments.py --questions 12
    python examples/rag_segments.py --client frontend_lang

The documents are Python's own reference topics (`pydoc_data.topics`). A prefix cache would
find only the system prompt: the documents come in another order, after other documents, for
almost every question. Sent as segments, each document is computed once on its own and then
reused at any position, with a share of its tokens recomputed in context. The reuse printed at
the end is the server's own count (`segment_tokens` of each answer), not assumed.

`--client openai` (the default) sends chat messages through the `openai` client, each document
a text part with `"segment": true`; `--client frontend_lang` writes the same conversation as a
frontend_lang program with `fl.segment`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import Counter

QUERIES = [
    "for loop statement", "while loop and break", "exceptions try except", "with statement context manager",
    "class definitions and inheritance", "function definitions and defaults", "import system and modules",
    "assignment statements", "comparisons and boolean operations", "lambda expressions",
    "string formatting", "the if statement",
]
SYSTEM = "Answer the question using only the documents. Be brief."


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z_]+", text.lower())


class Retriever:
    """tf-idf over the reference topics; each document cut to `max_chars`."""

    def __init__(self, max_chars: int) -> None:
        from pydoc_data.topics import topics

        self.texts = {name: text[:max_chars].strip() for name, text in topics.items()}
        self.counts = {name: Counter(_words(text)) for name, text in topics.items()}
        self.df = Counter(w for counts in self.counts.values() for w in counts)

    def top(self, query: str, k: int) -> list[str]:
        n = len(self.counts)

        def score(name: str) -> float:
            counts = self.counts[name]
            return sum(math.log(1 + counts[w]) * math.log(n / self.df[w]) for w in _words(query) if w in counts)

        return [self.texts[name] for name in sorted(self.counts, key=score, reverse=True)[:k]]


def ask_openai(url: str, api_key: str | None, jobs: list[tuple[str, list[str]]], max_tokens: int) -> list[tuple[str, int, int]]:
    """Each (question, documents) as a chat whose documents are segment parts."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=api_key or "none")
    answers = []
    for question, documents in jobs:
        parts = [{"type": "text", "text": f"Document:\n{doc}\n\n", "segment": True} for doc in documents]
        parts.append({"type": "text", "text": f"Question: {question}"})
        reply = client.chat.completions.create(
            model="default", max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
        )
        details = reply.usage.prompt_tokens_details.model_dump()
        answers.append((reply.choices[0].message.content or "", reply.usage.prompt_tokens, details.get("segment_tokens", 0)))
    return answers


def ask_frontend_lang(url: str, api_key: str | None, jobs: list[tuple[str, list[str]]],
                      max_tokens: int) -> list[tuple[str, int, int]]:
    """The same conversations as a frontend_lang program: `fl.segment` marks the documents."""
    import frontend_lang as fl

    @fl.function
    def answer(s, documents: list[str], question: str) -> None:
        s += fl.system(SYSTEM)
        with s.user():
            for doc in documents:
                s += fl.segment(f"Document:\n{doc}\n\n")
            s += f"Question: {question}"
        s += fl.assistant(fl.gen("answer", max_tokens=max_tokens, temperature=0))

    with fl.RuntimeEndpoint(url, api_key=api_key) as backend:
        states = answer.run_batch([{"documents": d, "question": q} for q, d in jobs], backend=backend, num_threads=4)
    out = []
    for state in states:
        if state.error:
            raise RuntimeError(state.error)
        meta = state.meta_info("answer")
        out.append((state["answer"], meta["prompt_tokens"], meta["segment_tokens"]))
    return out


def main(argv: list[str] | None = None) -> list[tuple[str, int, int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", choices=("openai", "frontend_lang"), default="openai")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--doc-chars", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a radixserve server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    args = parser.parse_args(argv)

    retriever = Retriever(args.doc_chars)
    questions = [f"What does the documentation say about {QUERIES[i % len(QUERIES)]}?" for i in range(args.questions)]
    jobs = [(q, retriever.top(q, args.top_k)) for q in questions]
    ask = ask_openai if args.client == "openai" else ask_frontend_lang
    answers = ask(args.url, args.api_key, jobs, args.max_tokens)
    for (question, _), (text, _, _) in zip(jobs, answers, strict=True):
        print(f"Q: {question}\nA: {text.strip()}\n")
    prompt = sum(p for _, p, _ in answers)
    reused = sum(s for _, _, s in answers)
    print(f"prompt tokens {prompt}, reused from the segment cache {reused} ({reused / max(prompt, 1):.0%})")
    return answers


if __name__ == "__main__":
    main()
