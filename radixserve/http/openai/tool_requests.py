"""Tool calling on /v1/chat/completions, the request's side: checking `tools`, `tool_choice` and
`parallel_tool_calls`, rendering a conversation that has tools and tool calls in it, and the
grammar that makes `tool_choice: "required"` or a named function hold.

Rendering. A chat template that mentions `tools` (Qwen 2.5/3, Llama 3.1, Hermes, ...) renders
them itself: it gets the tool list and the messages, with each call's `arguments` string turned
into the object such templates expect. Any other template (the default model's plain ChatML)
gets a conversation written in the tool-call format (`tool_calls.ToolCallFormat`, hermes unless
`--tool-call-parser` says otherwise) in messages it can render: the tools and how to call them in
the system message (appended to the client's, or prepended), an assistant's calls as the text the
model would have written, and tool results as user turns of `<tool_response>` blocks (one user
turn for consecutive results; a template that knows no tool role may reject one, and every
template renders a user turn).

`tool_choice: "none"` shows no tools and reads no calls: the model answers in text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.front.types import InvalidRequest, json_type
from radixserve.front.validation.schemas import check_depth, check_json_schema
from radixserve.http.openai.tool_call_parser import ToolCallFormat
from radixserve.tokenizer import ChatSegments, apply_chat_template, apply_chat_template_segments

MAX_TOOLS = 128  # OpenAI's cap
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Runs of whitespace a constrained call may write inside its JSON: room for a newline and an
# indent, not for a model that loops on spaces until max_tokens.
GRAMMAR_MAX_WHITESPACE = 4

_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments{where}:\n{example}"
)


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request says about tools, checked. `choice` is "none", "auto", "required"
    or "named" (then `forced` names the function)."""

    tools: list[dict[str, Any]]
    choice: str
    forced: str | None
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def shown(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when the model must not call any."""
        return None if self.choice == "none" else self.tools

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def parse_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` of a chat body; None when it has no tools."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise InvalidRequest(f"`{key}` (the deprecated function calling) is not supported; use `tools`", param=key)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise InvalidRequest("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice is not None and choice not in ("none", "auto"):
            raise InvalidRequest("`tool_choice` needs `tools`", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise InvalidRequest("`tools` must be a list of function tools", param="tools")
    if len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"`tools` has {len(raw)} entries; at most {MAX_TOOLS} are allowed", param="tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise InvalidRequest(f"`tools` names the function {duplicate!r} twice", param="tools")
    kind, forced = _choice(choice, set(names))
    for i, t in enumerate(tools):  # the schemas a constrained choice compiles must hold as written
        if kind == "required" or (kind == "named" and t["function"]["name"] == forced):
            check_json_schema(t["function"].get("parameters") or {}, f"`tools[{i}].function.parameters`", "tools")
    return ToolRequest(tools, kind, forced, True if parallel is None else parallel)


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"`tools[{i}]`"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise InvalidRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got {name!r}", param="tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidRequest(f"{where}.function.description must be a string", param="tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", param="tools")
    if fn.get("parameters") is not None:
        check_depth(fn["parameters"], f"{where}.function.parameters", "tools")
    if fn.get("strict") is not None and type(fn["strict"]) is not bool:
        raise InvalidRequest(f"{where}.function.strict must be a boolean", param="tools")
    clean = {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}
    return {"type": "function", "function": clean}


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if not isinstance(name, str):
            raise InvalidRequest(
                f"`tool_choice.function.name` must be the name of a function in `tools` (a string), got {json_type(name)}",
                param="tool_choice",
            )
        if name not in names:
            raise InvalidRequest(f"`tool_choice` names the function {name!r}, which is not in `tools`", param="tool_choice")
        return "named", name
    raise InvalidRequest(
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


# ---------------------------------------------------------------------- the grammar


def grammar_tools(request: ToolRequest) -> list[dict[str, Any]]:
    """The tools as the grammar sees them: arguments are always an object (a tool without
    `parameters` takes none, as OpenAI reads it), and the schema holds even with
    `strict: false` (xgrammar would let such a tool's arguments be any JSON)."""
    return [
        {"type": "function", "function": {
            "name": t["function"]["name"],
            "parameters": t["function"].get("parameters") or {"type": "object", "properties": {}},
        }}
        for t in request.tools
    ]


def structural_tag(request: ToolRequest, fmt: ToolCallFormat, answer_schema: Any = None) -> str:
    """The structural tag (xgrammar's JSON) that a constrained tool choice decodes under: only
    calls, in `fmt`, to the allowed tools, with arguments valid for their schemas. With
    `answer_schema` (tool_choice auto and a JSON response format) the model may instead write
    that JSON: the one grammar that lets an agent both call tools and answer in a schema."""
    import xgrammar as xgr
    from xgrammar.structural_tag import JSONSchemaFormat, OrFormat, StructuralTag

    if request.choice == "named":
        choice: Any = {"type": "function", "function": {"name": request.forced}}
    else:
        choice = "required"
    try:
        tag = xgr.get_model_structural_tag(
            fmt.structural_tag_model, tools=grammar_tools(request), tool_choice=choice, reasoning="disabled",
            parallel_tool_calls=request.parallel, max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE,
        )
        if answer_schema is not None:
            answer = JSONSchemaFormat(json_schema=answer_schema, max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE)
            tag = StructuralTag(format=OrFormat(elements=[tag.format, answer]))
    except ValueError as exc:  # pydantic's checks of the tools (the schemas compile later)
        raise InvalidRequest(f"`tools` cannot be turned into a grammar: {exc}", param="tools") from None
    return tag.model_dump_json()


# ---------------------------------------------------------------------- rendering


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: a "tool_use" one knows tools
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def prompt_chars(chat: list[dict[str, Any]], request: ToolRequest | None) -> int:
    """Characters the tools add to a rendered prompt (their JSON and the instructions), for the
    check that refuses a prompt too long to tokenize."""
    if request is None or request.shown is None:
        return 0
    return len(json.dumps(request.shown, ensure_ascii=False)) + len(_TOOLS_PROMPT) + 200


def render_chat(
    tokenizer: Any, chat: list[dict[str, Any]], request: ToolRequest | None, fmt: ToolCallFormat,
    add_generation_prompt: bool,
) -> list[int]:
    """Token ids of a normalized conversation (`tokenizer.normalize_messages`) with its tools."""
    messages, tools = _template_input(tokenizer, chat, request, fmt)
    return apply_chat_template(tokenizer, messages, add_generation_prompt, tools=tools)


def render_chat_segments(
    tokenizer: Any, chat: list[dict[str, Any]], request: ToolRequest | None, fmt: ToolCallFormat,
    add_generation_prompt: bool, segments: ChatSegments,
) -> tuple[list[int], list[tuple[int, int]]]:
    """`render_chat` for a conversation with segment parts (`segments`' placeholders in its
    contents): the token ids and each part's span."""
    messages, tools = _template_input(tokenizer, chat, request, fmt)
    return apply_chat_template_segments(tokenizer, messages, segments, add_generation_prompt, tools=tools)


def _template_input(
    tokenizer: Any, chat: list[dict[str, Any]], request: ToolRequest | None, fmt: ToolCallFormat,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the template gets: tools for a template that renders them,
    else written into the conversation."""
    tools = request.shown if request is not None else None
    has_calls = any(m["role"] == "tool" or m.get("tool_calls") for m in chat)
    if not tools and not has_calls:
        return chat, None
    if template_knows_tools(tokenizer):
        return [_template_message(m) for m in chat], tools
    return _written_out(chat, tools, fmt), None


def _calls(message: Mapping[str, Any], i: int) -> list[tuple[str, str]]:
    """An assistant message's calls as (name, arguments JSON text), checked."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    where = f"messages[{i}].tool_calls"
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(f"`{where}` must be a list, on an assistant message", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"`{where}[{j}]` must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", param="messages")
        args = fn.get("arguments")
        if isinstance(args, Mapping):
            args = json.dumps(args, ensure_ascii=False)
        if args is None or args == "":
            args = "{}"
        if not isinstance(args, str):
            raise InvalidRequest(f"`{where}[{j}].function.arguments` must be a JSON string", param="messages")
        out.append((fn["name"], args))
    return out


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows tools: calls with `arguments` as objects (what such
    templates write with `tojson`; a string would come out quoted twice)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for j, (name, args) in enumerate(_calls(message, 0)):
        try:
            parsed: Any = json.loads(args)
        except ValueError:
            parsed = args
        original = message["tool_calls"][j]
        calls.append({
            "id": original.get("id"), "type": "function",
            "function": {"name": name, "arguments": parsed if isinstance(parsed, dict) else args},
        })
    return {**message, "tool_calls": calls}


def _written_out(chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The conversation as plain system/user/assistant turns, tools and calls written in `fmt`."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(chat):
        role, content = message["role"], message["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = _calls(message, i)
        if calls:
            written = "\n".join(fmt.render_call(name, args.strip()) for name, args in calls)
            content = f"{content}\n{written}" if content else written
        out.append({"role": role, "content": content})
    if tools:
        system = _tools_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _tools_prompt(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    where = f" within {fmt.open}{fmt.close} XML tags" if fmt.open else ""
    example = fmt.render_call("<function-name>", "<args-json-object>").replace('"<function-name>"', "<function-name>")
    return _TOOLS_PROMPT.format(tools=listing, where=where, example=example)
