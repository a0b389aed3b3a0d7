"""A chat's messages rendered into prompt token ids by the model's chat template, off the event loop: what the
template or its variables refuse is a 400 naming the field."""

from __future__ import annotations

import asyncio

from hybrid.tokenizer import DocumentsRefused, Tokenizer, TokenizerError
from server.api_error import ApiError
from server.protocol import ChatMessage


async def chat_prompt_ids(tok: Tokenizer, messages: list[ChatMessage], tools: list[dict] | None,
                          template_kwargs: dict | None, add_generation_prompt: bool = True,
                          continue_final_message: bool = False, documents: list[dict] | None = None) -> list[int]:
    try:
        tok.check_template_kwargs(template_kwargs or {})
    except TokenizerError as e:
        raise ApiError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
    try:
        rendered = [m.rendered() for m in messages]
        return await asyncio.to_thread(tok.apply_chat_template, rendered, tools, template_kwargs,
                                       add_generation_prompt, continue_final_message, documents)
    except DocumentsRefused as e:
        raise ApiError(400, f"documents: {e}", param="documents") from None
    except (ValueError, TokenizerError) as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # a chat template raising on an odd conversation is the caller's error
        raise ApiError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
