"""A ReAct-style agent: the model thinks, picks a tool, reads the tool's answer, and repeats.

    make serve                                   # in another terminal
    python examples/react_agent.py "What is 17 * 23 + 4?"

`select` picks the action among the tool names, so even a small model always writes a valid
action; `gen` with a stop string writes its argument. Each step's prompt extends the previous
one, so every call after the first finds the conversation so far in the cache.
"""

from __future__ import annotations

import argparse
import ast
import operator
import os

import frontend_lang as fl

SYSTEM = """You answer questions by thinking in steps and using tools.
Tools:
- calculator[expression]: evaluates arithmetic, e.g. calculator[12 * (3 + 4)]
- finish[answer]: gives the final answer
Each of your turns is one step:
Thought: <what to do next>
Action: <tool>[<input>]
After a calculator action you get an Observation with its result."""

EXAMPLE = [
    fl.user("What is 6 times 7, plus 1?"),
    fl.assistant("Thought: I will use the calculator.\nAction: calculator[6 * 7 + 1]"),
    fl.user("Observation: 43"),
    fl.assistant("Thought: The calculator says 43, so I can finish.\nAction: finish[43]"),
]

_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Arithmetic on numbers only (no names, no calls): never `eval` what a model wrote."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


TOOLS = {"calculator": calculator}


@fl.function
def react(s, question: str, max_steps: int = 5) -> str | None:
    s += fl.system(SYSTEM)
    s += EXAMPLE
    s += fl.user(question)
    for step in range(max_steps):
        with s.assistant():
            s += "Thought: "
            s += fl.gen(f"thought{step}", max_tokens=48, stop="\n")
            s += "\nAction: "
            s += fl.select(f"action{step}", choices=[*TOOLS, "finish"])
            s += "["
            s += fl.gen(f"input{step}", max_tokens=32, stop=["]", "\n"])
            s += "]"
        action, argument = s[f"action{step}"], s[f"input{step}"]
        if action == "finish":
            return argument
        s += fl.user(f"Observation: {TOOLS[action](argument)}")
    return None


def main(argv: list[str] | None = None) -> fl.ProgramState:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What is 17 * 23 + 4?")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a radixserve server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    parser.add_argument("--max-steps", type=int, default=5)
    args = parser.parse_args(argv)

    with fl.RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        state = react.run(
            question=args.question, max_steps=args.max_steps, backend=backend,
            default_sampling={"temperature": 0},
        )
    for message in state.messages()[len(EXAMPLE) + 1 :]:
        print(f"[{message['role']}] {message['content']}")
    print(f"\nanswer: {state.return_value}")
    print(f"cache: {state.cache_stats()}")
    return state


if __name__ == "__main__":
    main()
