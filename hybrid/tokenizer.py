"""The model's tokenizer and chat template, loaded offline from tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer


class TokenizerError(ValueError):
    """A tokenizer that is missing or cannot serve the request."""


class Tokenizer:
    """Encodes prompts (adding BOS where the model's tokenizer does) and renders chat messages."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json; pass token ids (--prompt-ids) instead of text")
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.backend: BackendTokenizer = self.hf.backend_tokenizer
        self.vocab_size = len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError("this model's tokenizer has no chat_template")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
