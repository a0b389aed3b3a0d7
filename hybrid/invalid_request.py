"""The error of a request no engine of this model can serve, and the check for text that is not Unicode."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request no engine of this model can serve; `param` and `code` follow OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, None where it has none: JSON's "\\ud800" parses into one,
    but it is not valid Unicode, so it can be neither encoded nor tokenized."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return e.start
    return None
