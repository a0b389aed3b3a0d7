"""The api's grammar check: each distinct grammar is compiled once against the model's tokenizer, on a worker
thread (never the event loop), and its verdict cached by the grammar's digest, so a bad schema is a 400 before the
engine sees it and the cache holds no request's text."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from hybrid.structured_output.backend import GrammarBackend, GrammarError, LazyBackend

CACHED_VERDICTS = 256


class GrammarChecker:
    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        self._backend = LazyBackend(make_backend)
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()

    def _compile(self, grammar: str) -> str | None:
        """What is wrong with the grammar, or None."""
        try:
            self._backend.get().check(grammar)
        except GrammarError as e:
            return str(e)
        return None

    def check(self, grammar: str) -> None:
        """Raises GrammarError when the grammar does not compile. Blocking: call it from a worker thread."""
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            cached = key in self._verdicts
            if cached:
                self._verdicts.move_to_end(key)
                verdict = self._verdicts[key]
        if not cached:
            verdict = self._compile(grammar)
            with self._lock:
                self._verdicts[key] = verdict
                if len(self._verdicts) > CACHED_VERDICTS:
                    self._verdicts.popitem(last=False)
        if verdict is not None:
            raise GrammarError(verdict)
