"""The shapes of OpenAI responses: a chat completion or a text completion, whole or as SSE chunks, with
`logprobs` in each API's own format (chat: `content` entries with bytes; completions: parallel lists with
text offsets), `echo` of the prompt on completions and of the begun reply on chat, and vLLM's `prompt_logprobs`
(per choice on completions, once for the response on chat; streamed, in the first chunk sent after the
prefill)."""

from __future__ import annotations

from hybrid.engine.outputs import TokenLogprob
from hybrid.managers.messages import TokenDelta
from hybrid.structured_output.tool_formats import ToolCall, ToolCallFormat, ToolCallStream
from hybrid.tokenizer import Tokenizer


class TokenText:
    """Token ids as the strings logprobs show: `token_id:N` for a model without a tokenizer, or everywhere but in
    prompt_logprobs with `as_ids` (vLLM's return_tokens_as_token_ids, which leaves prompt_logprobs text)."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ResponseShape:
    """Accumulates one choice's deltas and renders its chunks and final body (under the request's id: a request
    asking for `n` choices has one shape each, told apart by `index`). `chunk` returns None when a delta carries
    nothing to send (text held back by the stop-string check, and no logprobs). `echo_text` (None: no echo)
    comes before the first delta's text; `prompt_logprobs` (None: not asked) is how many alternatives each prompt
    token's entry shows; `shown_prompt_ids` (vLLM's return_token_ids) puts the prompt's and the generated token
    ids beside the text."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, rid: str, model: str, created: int, token_text: TokenText, logprobs: bool,
                 echo_text: str | None = None, prompt_logprobs: int | None = None,
                 shown_prompt_ids: list[int] | None = None):
        self.rid, self.model, self.created, self.token_text, self.logprobs = rid, model, created, token_text, logprobs
        self.echo_text = echo_text
        self.prompt_top = prompt_logprobs
        self.shown_prompt_ids = shown_prompt_ids  # with vLLM's return_token_ids: the prompt's ids, else None
        self.token_ids: list[int] = []
        self.unsent_ids: list[int] = []  # generated, not yet in a chunk (a chunk held back leaves them here)
        self.sent_prompt_ids = False
        self.sent_prompt_logprobs = False
        self.prompt_entries: list[TokenLogprob | None] = []
        self.index = 0  # the choice's place among the request's `n`
        self.parts: list[str] = []
        self.entries: list = []
        self.finish_reason: str | None = None

    def body(self, choices: list[dict], chunk: bool, usage: dict | None = None) -> dict:
        out = {"id": f"{self.id_prefix}-{self.rid}", "object": self.chunk_object_name if chunk else self.object_name,
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    def opening(self) -> dict | None:
        return None

    def usage_chunk(self, usage: dict) -> dict:
        return self.body([], True, usage)

    def add(self, msg: TokenDelta) -> tuple[str, list]:
        """Records a delta; returns its text and logprob entries."""
        text, entries = msg.text, self.new_entries(msg) if self.logprobs else []
        if self.echo_text and not self.parts:
            text = self.echo_text + text
        self.parts.append(text)
        self.entries += entries
        self.token_ids += msg.token_ids
        self.unsent_ids += msg.token_ids
        if self.prompt_top is not None and msg.prompt_logprobs:
            self.prompt_entries += msg.prompt_logprobs
        if msg.finished:
            self.finish_reason = msg.finish_reason
        return text, entries

    def ids_json(self, chunk: bool) -> dict:
        """A choice's `token_ids` (a chunk's: those since the last chunk sent) when they were asked for."""
        if self.shown_prompt_ids is None:
            return {}
        ids = self.unsent_ids if chunk else self.token_ids
        self.unsent_ids = []
        return {"token_ids": ids}

    def prompt_ids_json(self, chunk: bool) -> dict:
        """`prompt_token_ids` when they were asked for: in the whole body, or in the first chunk sent."""
        if self.shown_prompt_ids is None or (chunk and self.sent_prompt_ids):
            return {}
        self.sent_prompt_ids = chunk
        return {"prompt_token_ids": self.shown_prompt_ids}

    def prompt_logprobs_json(self, chunk: bool) -> dict:
        """`prompt_logprobs` when they were asked for: in the whole body, or in the first chunk sent once the
        prefill gave them (a chunk held back by the stop-string check leaves them for the next one)."""
        if self.prompt_top is None or (chunk and (self.sent_prompt_logprobs or not self.prompt_entries)):
            return {}
        self.sent_prompt_logprobs = chunk
        return {"prompt_logprobs": self.prompt_logprob_entries()}

    def prompt_logprob_entries(self) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first, which nothing predicts, has None) the logprob, rank
        and text of the token itself and of the most likely ones, keyed by token id, the token itself first."""
        out: list[dict | None] = []
        for lp in self.prompt_entries:
            if lp is None:
                out.append(None)
                continue
            ranked = [(lp.token_id, lp.logprob, lp.rank)]
            ranked += [(t, v, rank) for rank, (t, v) in enumerate(lp.top[:self.prompt_top], 1)]
            entry: dict = {}
            for t, v, rank in ranked:
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.token_text.text(t)})
            out.append(entry)
        return out

    def new_entries(self, msg: TokenDelta) -> list:
        raise NotImplementedError

    def chunk(self, msg: TokenDelta) -> dict | None:
        raise NotImplementedError

    def final(self, usage: dict) -> dict:
        raise NotImplementedError


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


class ChatShape(ResponseShape):
    """With a tool-call format, the reply is split into content and `tool_calls` (streamed as each call
    completes), and a reply that called tools finishes with "tool_calls". `echo_text` (vLLM's chat `echo`: the
    reply the client began) comes before the generated text."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, rid: str, model: str, created: int, token_text: TokenText, logprobs: bool,
                 tool_format: ToolCallFormat | None = None, parallel_tool_calls: bool = True, echo_text: str = "",
                 prompt_logprobs: int | None = None, shown_prompt_ids: list[int] | None = None):
        super().__init__(rid, model, created, token_text, logprobs, echo_text or None, prompt_logprobs,
                         shown_prompt_ids)
        self.tools = ToolCallStream(tool_format, parallel_tool_calls) if tool_format is not None else None

    def reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return finish_reason

    def opening(self) -> dict:
        return self.body([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}], True)

    def entry(self, lp: TokenLogprob) -> dict:
        token = self.token_text(lp.token_id)
        top = [{"token": (t := self.token_text(i)), "logprob": v, "bytes": list(t.encode())} for i, v in lp.top]
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()), "top_logprobs": top}

    def new_entries(self, msg: TokenDelta) -> list:
        return [self.entry(lp) for lp in msg.logprobs or []]

    def chunk(self, msg: TokenDelta) -> dict | None:
        text, entries = self.add(msg)
        delta: dict = {"content": text}
        if self.tools is not None:
            first = len(self.tools.calls)
            content, calls = self.tools.feed(text, msg.finished)
            delta = {"content": content} if content or not calls else {}
            if calls:
                delta["tool_calls"] = [tool_call_json(c, first + i) for i, c in enumerate(calls)]
        if not (delta.get("content") or delta.get("tool_calls") or msg.finished or entries):
            return None
        logprobs = {"content": entries, "refusal": None} if self.logprobs else None
        return {**self.body([{"index": self.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": self.reason(msg.finish_reason), **self.ids_json(True)}], True),
                **self.prompt_ids_json(True), **(self.prompt_logprobs_json(True) if self.index == 0 else {})}

    def final(self, usage: dict) -> dict:
        logprobs = {"content": self.entries, "refusal": None} if self.logprobs else None
        message: dict = {"role": "assistant", "content": "".join(self.parts)}
        if self.tools is not None:
            content, calls = self.tools.feed(message["content"], True)
            message["content"] = content
            if calls:
                message.update(content=content or None, tool_calls=[tool_call_json(c) for c in calls])
        body = self.body([{"index": self.index, "message": message, "logprobs": logprobs,
                           "finish_reason": self.reason(self.finish_reason), **self.ids_json(False)}], False, usage)
        return {**body, **self.prompt_ids_json(False), **self.prompt_logprobs_json(False)}


class CompletionShape(ResponseShape):
    """`echo` puts the prompt's text (and, with logprobs, its tokens' logprobs) before the completion."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, rid: str, model: str, created: int, token_text: TokenText, logprobs: int | None,
                 echo_text: str | None, prompt_ids: list[int], prompt_logprobs: int | None = None,
                 return_token_ids: bool = False):
        super().__init__(rid, model, created, token_text, logprobs is not None, echo_text, prompt_logprobs,
                         prompt_ids if return_token_ids else None)
        self.top = logprobs or 0
        self.first_prompt_id = prompt_ids[0]
        self.offset = 0

    def new_entries(self, msg: TokenDelta) -> list:
        """(token id, logprob, top) per token; the prompt's first token, which nothing predicts, has None."""
        entries = []
        if self.echo_text is not None and msg.prompt_logprobs:
            entries = [(self.first_prompt_id, None, None) if lp is None
                       else (lp.token_id, lp.logprob, lp.top[:self.top]) for lp in msg.prompt_logprobs]
        return entries + [(lp.token_id, lp.logprob, lp.top) for lp in msg.logprobs or []]

    def lists(self, entries: list) -> dict:
        """OpenAI's legacy logprobs: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in entries:
            token = self.token_text(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else {self.token_text(t): v for t, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def chunk(self, msg: TokenDelta) -> dict | None:
        text, entries = self.add(msg)
        if not (text or msg.finished or entries):
            return None
        logprobs = self.lists(entries) if self.logprobs else None
        return self.body([{"index": self.index, "text": text, "logprobs": logprobs,
                           "finish_reason": msg.finish_reason, **self.prompt_ids_json(True), **self.ids_json(True),
                           **self.prompt_logprobs_json(True)}], True)

    def final(self, usage: dict) -> dict:
        logprobs = self.lists(self.entries) if self.logprobs else None
        choice = {"index": self.index, "text": "".join(self.parts), "logprobs": logprobs,
                  "finish_reason": self.finish_reason, **self.prompt_ids_json(False), **self.ids_json(False),
                  **self.prompt_logprobs_json(False)}
        return self.body([choice], False, usage)
