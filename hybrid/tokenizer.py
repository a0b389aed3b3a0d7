"""The model's tokenizer and chat template, loaded offline from tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from hybrid.invalid_request import lone_surrogate_at

# Roles whose content is text a person typed: it is tokenized with special tokens read as plain text.
TYPED_ROLES = ("user", "system", "tool")
# A content placeholder the template passes through untouched: private-use code points no tokenizer merges with.
_SLOT = "\ue000{}\ue001"
# The template's own text in one rendering (the typed texts are slotted out): past this it repeats without bound,
# and encoding it would take the process's memory.
MAX_TEMPLATE_TEXT = 1 << 24
_SLOT_RE = re.compile("(\ue000\\d+\ue001)")


class TokenizerError(ValueError):
    """A tokenizer that is broken or cannot serve the request."""


class MissingTokenizer(TokenizerError):
    """A model directory without tokenizer.json: it can still serve token ids."""


class DocumentsRefused(TokenizerError):
    """Documents given to a chat template that never reads them, or whose field names hold a special token."""


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (as vLLM's --chat-template takes it),
    checked to parse; raises TokenizerError naming the problem."""
    if "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text()
        except OSError as e:
            raise TokenizerError(f"--chat-template {value!r}: not a Jinja template, and not a file that can be "
                                 f"read ({e.strerror})") from None
    try:
        check_template_syntax(text)
    except TokenizerError as e:
        raise TokenizerError(f"--chat-template: {e}") from None
    return text


def check_template_syntax(template: object) -> None:
    """Raises TokenizerError unless `template` is Jinja text that parses, naming the line that does not."""
    import jinja2

    if not isinstance(template, str):
        raise TokenizerError(f"is not text but {type(template).__name__}")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"line {e.lineno}: {e.message}") from None


def _first_words(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


class Tokenizer:
    """Encodes prompts (adding BOS where the model's tokenizer does) and renders chat messages with the model's
    chat template, or with `chat_template` (Jinja text) where given."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise MissingTokenizer(f"{model_dir}: no tokenizer.json; pass token ids (--prompt-ids) instead of text")
        from transformers import AutoTokenizer

        config = model_dir / "tokenizer_config.json"
        try:
            BackendTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises many types for a broken file
            raise TokenizerError(f"{path}: not a tokenizer this version of `tokenizers` can load "
                                 f"({_first_words(e)})") from None
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:  # tokenizer.json loads, so what transformers refuses is its configuration
            raise TokenizerError(f"{config}: transformers cannot set the tokenizer up from it ({_first_words(e)})") \
                from None
        limit = self.hf.model_max_length
        if not isinstance(limit, (int, float)) or isinstance(limit, bool):  # transformers compares it per encode
            raise TokenizerError(f"{config}: model_max_length must be a number, got {limit!r}")
        self.backend: BackendTokenizer = self.hf.backend_tokenizer
        self.vocab_size = len(self.hf)
        self.template_source = f"{config}: its chat_template"
        self._checked_template: object = None
        if chat_template is not None:
            self.use_chat_template(chat_template)

    def use_chat_template(self, chat_template: str) -> None:
        """Renders chats with `chat_template` (Jinja text, see load_chat_template) instead of the model's."""
        self.hf.chat_template = chat_template
        self.template_source = "--chat-template"

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids; `add_special_tokens` adds what the tokenizer puts around a text (BOS, say)."""
        return self._encode(text, add_special_tokens=add_special_tokens)

    def word_ids(self, word: str) -> list[list[int]]:
        """The word's ids as it tokenizes at the start of a text, and after a space where that spelling is a word
        of its own (as many tokens, another first token), without special tokens: vLLM's reading of bad_words."""
        plain, spaced = (self.encode(text, add_special_tokens=False) for text in (word.lstrip(), " " + word.lstrip()))
        if not plain:  # nothing but spaces
            return []
        return [plain, spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, documents: list[dict] | None = None) -> list[int]:
        """Renders the conversation (and the tools offered, in the template's own tool section); the template's
        own markers become special tokens, while a marker a user typed (`<|im_end|>` in a message) stays text,
        so nobody can forge a turn boundary. `template_kwargs` are variables for the template (Qwen3's
        `enable_thinking`, say); they may not name the rendering's own arguments. `continue_final_message`
        leaves the last message open (no end-of-turn marker after it), so the model continues it: a reply the
        client has begun. `documents` (for retrieval-augmented templates: title/text fields, say) are rendered
        where the template reads them, their text kept text as a user's is; a template that never reads them
        refuses them rather than dropping them."""
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError("this model's tokenizer has no chat_template")
        if self.hf.chat_template is not self._checked_template:  # parsed once, not per conversation
            try:
                for template in self._templates():
                    check_template_syntax(template)
            except TokenizerError as e:
                raise TokenizerError(f"{self.template_source} {e} (--chat-template replaces it)") from None
            self._checked_template = self.hf.chat_template
        template_kwargs = template_kwargs or {}
        self.check_template_kwargs(template_kwargs)
        typed: dict[str, str] = {}

        def slot(text: str) -> str:
            typed[key := _SLOT.format(len(typed))] = text
            return key

        slotted = []
        for m in messages:
            content = m.get("content")
            if m.get("role") in TYPED_ROLES and isinstance(content, str) and content:
                m = {**m, "content": slot(content)}
            slotted.append(m)
        if documents is not None:
            if "documents" not in self._template_for(tools):
                raise DocumentsRefused("this model's chat template does not read documents (a --chat-template that "
                                      "does can be given)")
            # The template looks fields up by name, so names stay as typed: one holding a marker is refused.
            if forged := self.special_tokens_in(*(k for d in documents for k in d)):
                raise DocumentsRefused(f"a document's field name holds the special token {forged[0]!r}")
            documents = [{k: slot(v) if isinstance(v, str) and v else v for k, v in d.items()} for d in documents]
        import jinja2

        try:
            text = self.hf.apply_chat_template(slotted, tools=tools, documents=documents, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, **template_kwargs)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or what it reads is not there
            raise TokenizerError(f"the chat template failed on this conversation: {e}") from None
        except Exception as e:  # what the template's own expressions raise: 1/0, a range past the sandbox's, ...
            raise TokenizerError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None
        if len(text) > MAX_TEMPLATE_TEXT:
            raise TokenizerError(f"the chat template rendered {len(text):,} characters of its own for this "
                                 f"conversation (more than {MAX_TEMPLATE_TEXT:,}): it repeats text without bound")
        ids: list[int] = []
        for piece in _SLOT_RE.split(text):
            if piece in typed:
                ids += self._encode(typed[piece], add_special_tokens=False, split_special_tokens=True)
            elif piece:
                ids += self._encode(piece, add_special_tokens=False)
        return ids

    def _encode(self, text: str, **kw) -> list[int]:
        try:
            return self.hf.encode(text, **kw)
        except TypeError:  # what the tokenizers library raises for a str it cannot hand to Rust
            at = lone_surrogate_at(text)
            if at is None:
                raise
            raise TokenizerError(f"the text holds a lone surrogate ({text[at]!r} at character {at}): it is not valid "
                                 "Unicode") from None

    def _template_for(self, tools: list[dict] | None) -> str:
        """The template transformers renders a conversation with: of a named set, `tool_use` where tools are
        passed (even an empty list, as transformers picks) and the set has one, else `default` (no request names
        another)."""
        t = self.hf.chat_template
        if not isinstance(t, dict):
            return t
        return t["tool_use"] if tools is not None and "tool_use" in t else t.get("default", "")

    def _templates(self) -> list[str]:
        """The chat template's text: one, or each of a named set (transformers picks among them per call)."""
        t = self.hf.chat_template
        return list(t.values()) if isinstance(t, dict) else [t]

    def check_template_kwargs(self, template_kwargs: dict) -> None:
        """Refuses template variables that would set the rendering's own arguments (tokenize, tools, ...) or the
        special tokens it renders (bos_token, ...), and values holding a special token: text the template renders
        becomes tokens with the markers parsed, so such a value could forge a turn boundary."""
        if not template_kwargs:  # the usual request: nothing to check
            return
        reserved = set(inspect.signature(self.hf.apply_chat_template).parameters) - {"kwargs"}
        reserved |= set(self.hf.special_tokens_map)
        if taken := sorted(reserved & set(template_kwargs)):
            raise TokenizerError(f"these names are the template's own and cannot be set: {', '.join(taken)}")
        text = json.dumps(template_kwargs, ensure_ascii=False)
        if forged := self.special_tokens_in(text):
            raise TokenizerError(f"values may not hold the tokenizer's special tokens ({', '.join(forged[:3])})")

    def special_tokens_in(self, *texts: str) -> list[str]:
        """The added tokens that the texts spell out: rendered by a template, they would become those tokens."""
        added = self.added_tokens
        return sorted({t for text in texts for t in added if t in text})

    @property
    def added_tokens(self) -> set[str]:
        """Tokens added to the vocabulary whole (special markers, tool-call tags)."""
        return set(self.hf.get_added_vocab())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
