"""How a model writes tool calls: each format knows its markers, parses calls out of generated text (whole or
as it streams) and writes the grammar that forces calls (`tool_choice` "required" or a named function).

The format is read off the model's chat template: Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
(Qwen3, Qwen2.5) or DeepSeek-V3's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json ARGS```` blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from hybrid.structured_output.grammars import json_value, object_schema


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Function:
    """A tool the request offers: its name and the JSON schema of its arguments (None: no arguments)."""

    name: str
    parameters: dict | None = None


class ToolCallFormat(ABC):
    """`start` opens the tool calls in a reply; text before it is the reply's content."""

    start: str

    def __init__(self, added_tokens: set[str]):
        self.added_tokens = added_tokens

    @staticmethod
    @abstractmethod
    def matches(chat_template: str) -> bool:
        """True when the chat template renders tool calls in this format."""

    @abstractmethod
    def complete_calls(self, text: str) -> list[ToolCall]:
        """The calls fully written in `text` (the part from `start` on), in order; a malformed one ends the
        list."""

    @abstractmethod
    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """Lark text for one call (or, when parallel, one or more) of `functions`, and nothing else."""

    def literal(self, marker: str) -> str:
        """A marker in the grammar: the token itself (Lark `<...>` names a token) when the tokenizer has it as one
        token, else its text."""
        return marker if marker in self.added_tokens else json.dumps(marker, ensure_ascii=False)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished reply's content and calls; a reply whose calls do not parse is all content."""
        at = text.find(self.start)
        if at == -1:
            return text, []
        calls = self.complete_calls(text[at:])
        return (text[:at], calls) if calls else (text, [])


def _object_text(text: str) -> str | None:
    """text, stripped, when it is one JSON object; kept as the model wrote it (re-encoding would turn 1e999
    into Infinity and round long numbers)."""
    try:
        value, end = json.JSONDecoder().raw_decode(text := text.strip())
    except json.JSONDecodeError:
        return None
    return text if isinstance(value, dict) and end == len(text) else None


_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


class HermesFormat(ToolCallFormat):
    start = "<tool_call>"
    end = "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    @staticmethod
    def matches(chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def complete_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._call.finditer(text):
            raw = m.group(1).strip()
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                break
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                break
            args = self._raw_arguments(raw, body)
            if args is None:
                break
            calls.append(ToolCall(body["name"], args))
        return calls

    @staticmethod
    def _raw_arguments(raw: str, body: dict) -> str | None:
        """The arguments object's own text in the call's JSON (a string holding JSON is accepted too)."""
        value = body.get("arguments", {})
        if isinstance(value, str):
            return _object_text(value)
        at = _ARGUMENTS.search(raw)
        if not isinstance(value, dict) or at is None:
            return None
        _, end = json.JSONDecoder().raw_decode(raw, at.end())
        return raw[at.end():end]

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        bodies = [{"type": "object",
                   "properties": {"name": {"const": f.name}, "arguments": object_schema(f.parameters)},
                   "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return (f"{start}\ncall: {self.literal(self.start)} \"\\n\" {json_value(body)} \"\\n\" "
                f"{self.literal(self.end)}")


FENCE = "\n```json\n"


class DeepSeekV3Format(ToolCallFormat):
    start = "<｜tool▁calls▁begin｜>"
    end = "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]*)\n```json\n(.*?)\n```<｜tool▁call▁end｜>",
                       re.DOTALL)

    @staticmethod
    def matches(chat_template: str) -> bool:
        return "<｜tool▁calls▁begin｜>" in chat_template and "```json" in chat_template

    def complete_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._call.finditer(text):
            args = _object_text(m.group(3))
            if args is None:
                break
            calls.append(ToolCall(m.group(2).strip(), args))
        return calls

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        lit = self.literal
        rules = [f'call_{i}: {lit(self.call_begin)} "function" {lit(self.sep)} {json.dumps(f.name + FENCE)} '
                 f'{json_value(object_schema(f.parameters))} "\\n```" {lit(self.call_end)}'
                 for i, f in enumerate(functions)]
        calls = 'call ("\\n" call)*' if parallel else "call"
        return "\n".join([f"start: {lit(self.start)} {calls} {lit(self.end)}",
                          "call: " + " | ".join(f"call_{i}" for i in range(len(functions))), *rules])


FORMATS: tuple[type[ToolCallFormat], ...] = (HermesFormat, DeepSeekV3Format)


def format_for(chat_template: str | None, added_tokens: set[str]) -> ToolCallFormat | None:
    """The tool-call format the chat template renders, or None when it has no tool calls hybridd can read."""
    for fmt in FORMATS:
        if chat_template and fmt.matches(chat_template):
            return fmt(added_tokens)
    return None


class ToolCallStream:
    """Splits a reply arriving in pieces into content and tool calls: content streams until the format's start
    marker (a tail that may be the marker's beginning is held back), each call is released once complete, and
    a reply whose tool section never parses is released as content when it finishes. Not `parallel`
    (parallel_tool_calls false): the first call only."""

    def __init__(self, fmt: ToolCallFormat, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.text = ""
        self.sent = 0  # characters of text released as content
        self.start: int | None = None  # where the tool section begins
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """Adds a piece; returns the content and the calls it releases."""
        self.text += delta
        if self.start is None:
            at = self.text.find(self.fmt.start, max(0, self.sent - len(self.fmt.start)))
            if at == -1:
                end = len(self.text) if finished else len(self.text) - _partial_marker(self.text, self.fmt.start)
                content, self.sent = self.text[self.sent:end], max(self.sent, end)
                return content, []
            self.start = at
        content, self.sent = self.text[self.sent:self.start], max(self.sent, self.start)
        calls = self.fmt.complete_calls(self.text[self.start:])
        if not self.parallel:
            calls = calls[:1]
        new, self.calls = calls[len(self.calls):], self.calls + calls[len(self.calls):]
        if finished and not self.calls:
            content, self.sent = content + self.text[self.sent:], len(self.text)
        return content, new


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest tail of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
