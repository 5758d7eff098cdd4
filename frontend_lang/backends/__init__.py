"""Backends: where a program's calls go."""

from frontend_lang.backends.base import Backend, BackendError
from frontend_lang.backends.engine import EngineBackend
from frontend_lang.backends.runtime import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "EngineBackend", "RuntimeEndpoint"]
