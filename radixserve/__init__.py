"""radixserve: an LLM serving runtime built around prefix caching.

`Engine` is imported lazily so that `import radixserve` stays cheap in processes that only
need a submodule.
"""

from __future__ import annotations

from typing import Any

from radixserve.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
