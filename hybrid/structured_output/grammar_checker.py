"""The api's grammar check: each distinct grammar is compiled once against the model's tokenizer, on a worker
thread (never the event loop), and its verdict cached, so a bad schema is a 400 before the engine sees it."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from hybrid.structured_output.backend import GrammarBackend, GrammarError

CACHED_VERDICTS = 256


class GrammarChecker:
    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._verdict = functools.lru_cache(CACHED_VERDICTS)(self._compile)

    def _compile(self, grammar: str) -> str | None:
        """What is wrong with the grammar, or None."""
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
        try:
            self._backend.check(grammar)
        except GrammarError as e:
            return str(e)
        return None

    def check(self, grammar: str) -> None:
        """Raises GrammarError when the grammar does not compile. Blocking: call it from a worker thread."""
        if (verdict := self._verdict(grammar)) is not None:
            raise GrammarError(verdict)
