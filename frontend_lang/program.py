"""`@fl.function`: a Python function over a state becomes a program you can run, batch,
stream and await.

    @fl.function
    def qa(s, question):
        s += fl.user(question)
        s += fl.assistant(fl.gen("answer", max_tokens=64))

    state = qa.run(question="Why is the sky blue?")
    print(state["answer"], state.cache_stats())
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend_lang.backends.base import Backend
from frontend_lang.primitives import sampling_params
from frontend_lang.state import ProgramState, Run

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs run on when `run` is not given one."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Program:
    """A program: `run`, `run_batch`, `run_async`; calling it with a state runs its body inline
    (a program can call another on its own state)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.fn(s, *args, **kwargs)

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False,
        default_sampling: dict[str, Any] | None = None, **kwargs: Any,
    ) -> ProgramState:
        """Run the program to the end and return its state; raises the first error.

        `default_sampling`: gen keywords (`max_tokens`, `temperature`, ...) for every gen that
        does not set them. `stream=True`: return at once while the program runs in a background
        thread; read pieces with `state.text_iter(name)`. Reading the state (`state[name]`,
        `state.text()`) then waits for the program and raises its error, if any.
        """
        state = self._new_state(backend, stream, default_sampling)
        if stream:
            thread = threading.Thread(target=self._execute, args=(state, args, kwargs, False), daemon=True)
            thread.start()
        else:
            self._execute(state, args, kwargs, raise_error=True)
        return state

    async def run_async(self, *args: Any, **kwargs: Any) -> ProgramState:
        """`run` for asyncio code: the program runs in a worker thread, the loop stays free."""
        return await asyncio.to_thread(functools.partial(self.run, *args, **kwargs))

    def run_batch(
        self, batch_kwargs: Sequence[dict[str, Any]], *, backend: Backend | None = None,
        num_threads: int | None = None, progress_bar: bool = False,
        default_sampling: dict[str, Any] | None = None,
    ) -> list[ProgramState]:
        """Run the program once per dict of arguments, `num_threads` at a time (default: all,
        up to 64), and return the states in input order. A failed item does not stop the others:
        its state's `error` says why (reading the state raises it)."""
        items = list(batch_kwargs)
        if not items:
            return []
        if not all(isinstance(item, dict) for item in items):
            raise TypeError("run_batch takes a list of dicts of keyword arguments")
        workers = num_threads or min(len(items), 64)
        states = [self._new_state(backend, False, default_sampling) for _ in items]
        bar = _progress(len(items)) if progress_bar else None
        def one(i: int) -> None:
            self._execute(states[i], (), items[i], raise_error=False)
            if bar is not None:
                bar.update(1)

        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="frontend_lang-batch") as pool:
                list(pool.map(one, range(len(items))))
        finally:
            if bar is not None:
                bar.close()
        return states

    async def run_batch_async(self, batch_kwargs: Sequence[dict[str, Any]], **options: Any) -> list[ProgramState]:
        """`run_batch` for asyncio code."""
        return await asyncio.to_thread(functools.partial(self.run_batch, batch_kwargs, **options))

    def _new_state(self, backend: Backend | None, stream: bool, default_sampling: dict[str, Any] | None) -> ProgramState:
        backend = backend or _default_backend
        if backend is None:
            raise RuntimeError(
                "no backend: pass run(..., backend=...) or call fl.set_default_backend(...) first"
            )
        return ProgramState(Run(backend, sampling_params(**(default_sampling or {})), stream))

    def _execute(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any], raise_error: bool) -> None:
        run = state._run
        run.program_thread = threading.get_ident()
        try:
            value = self.fn(state, *args, **kwargs)
            run.wait_all()  # every branch finished; the first failure is the program's
        except BaseException as exc:  # noqa: BLE001 - recorded on the state, re-raised by run
            run.wait_all(raise_error=False)
            run.finish(exc)
            if raise_error:
                raise
            return
        state.return_value = value
        run.finish()


def function(fn: Callable[..., Any] | None = None) -> Any:
    """Decorator: `@fl.function` (or `@fl.function()`) over `def program(s, **args)`."""
    if fn is None:
        return function
    return Program(fn)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="program")
