"""The api's grammar check: each distinct grammar is compiled once against the model's tokenizer, on a worker
thread (never the event loop), and its verdict cached, so a bad schema is a 400 before the engine sees it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from hybrid.structured_output.backend import GrammarBackend, GrammarError

CACHED_VERDICTS = 256


class GrammarChecker:
    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        """Raises GrammarError when the grammar does not compile. Blocking: call it from a worker thread."""
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            known = grammar in self._verdicts
            verdict = self._verdicts.pop(grammar, None)
        if not known:
            try:
                self._backend.check(grammar)
            except GrammarError as e:
                verdict = str(e)
        with self._lock:
            self._verdicts[grammar] = verdict
            while len(self._verdicts) > CACHED_VERDICTS:
                self._verdicts.popitem(last=False)
        if verdict is not None:
            raise GrammarError(verdict)
