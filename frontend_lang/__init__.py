"""frontend_lang: a Python language for programs that call a model many times over a shared,
growing context (agents, RAG, search), with prefix sharing by construction.

    import frontend_lang as fl

    @fl.function
    def qa(s, question):
        s += fl.system("Answer in one word.")
        s += fl.user(question)
        s += fl.assistant(fl.gen("answer", max_tokens=8, temperature=0))

    fl.set_default_backend(fl.RuntimeEndpoint("http://127.0.0.1:30000"))
    state = qa.run(question="What colour is the sky?")
    print(state["answer"], state.cache_stats())

See docs/frontend_lang.md.
"""

from frontend_lang.backends import Backend, BackendError, EngineBackend, RuntimeEndpoint
from frontend_lang.cache import pin, unpin
from frontend_lang.chat_template import ChatTemplate
from frontend_lang.primitives import (
    assistant,
    assistant_begin,
    assistant_end,
    document,
    gen,
    segment,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend_lang.program import Program, function, get_default_backend, set_default_backend
from frontend_lang.scoring import ChoiceScore, Scores
from frontend_lang.state import CacheStats, CallRecord, ForkGroup, ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "CacheStats",
    "CallRecord",
    "ChatTemplate",
    "ChoiceScore",
    "EngineBackend",
    "ForkGroup",
    "Program",
    "ProgramState",
    "RuntimeEndpoint",
    "Scores",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "document",
    "function",
    "gen",
    "get_default_backend",
    "pin",
    "segment",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "unpin",
    "user",
    "user_begin",
    "user_end",
]
