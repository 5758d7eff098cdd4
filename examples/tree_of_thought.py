"""Tree-of-thought search: propose several next steps with `fork`, rate each with `select`, keep
the best, and go one level deeper.

    make serve                                   # in another terminal
    python examples/tree_of_thought.py "A farmer has 17 sheep; all but 9 run away. How many are left?"

Each level forks the best path so far: the branches share its text, which `fork` sends once, so
every branch and every rating call finds it in the cache.
"""

from __future__ import annotations

import argparse
import os

import frontend_lang as fl


@fl.function
def tree_of_thought(s, problem: str, breadth: int = 3, depth: int = 2, step_tokens: int = 48) -> fl.ProgramState:
    s += fl.system("Solve the problem. Think in short, numbered steps, then give the answer.")
    s += fl.user(problem)
    s += fl.assistant_begin()
    best = s
    tree = []
    for level in range(1, depth + 1):
        branches = best.fork(breadth)
        for i, branch in enumerate(branches):
            branch += f"Step {level}: "
            branch += fl.gen("step", max_tokens=step_tokens, stop="\n", temperature=0.8, seed=100 * level + i)
            branch += "\n"
        ratings = []
        for branch in branches:
            judge = branch.fork(1)[0]  # a side branch: the verdict does not enter the path
            judge += "Is this last step correct and useful? Answer: "
            judge += fl.select("verdict", choices=["yes", "no"])
            scores = {c.choice: c.normalized for c in judge.meta_info("verdict")["scores"]}
            ratings.append(scores["yes"] - scores["no"])
        tree.append([(b["step"], rating) for b, rating in zip(branches, ratings)])
        best = branches[max(range(breadth), key=ratings.__getitem__)]
    best += "Answer: "
    best += fl.gen("answer", max_tokens=32, stop="\n", temperature=0)
    best += fl.assistant_end()
    s["tree"] = tree
    s["answer"] = best["answer"]
    return best


def main(argv: list[str] | None = None) -> fl.ProgramState:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problem", nargs="?", default="A farmer has 17 sheep; all but 9 run away. How many are left?")
    parser.add_argument("--breadth", type=int, default=3)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a radixserve server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    args = parser.parse_args(argv)

    with fl.RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        state = tree_of_thought.run(problem=args.problem, breadth=args.breadth, depth=args.depth, backend=backend)
    for level, options in enumerate(state["tree"], 1):
        print(f"level {level}:")
        for step, rating in options:
            print(f"  {rating:+.3f}  {step.strip()}")
    print(f"\npath kept:\n{state.return_value.messages()[-1]['content']}")
    print(f"answer: {state['answer'].strip()}")
    print(f"cache: {state.cache_stats()}")
    return state


if __name__ == "__main__":
    main()
