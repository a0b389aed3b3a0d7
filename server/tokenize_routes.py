"""/tokenize and /detokenize (vLLM's and llama-server's shapes in one: each reads the fields of its own) and
/version. They need the tokenizer, not the engine: they answer while the engine loads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter

import hybrid
from hybrid.tokenizer import Tokenizer, TokenizerError
from server.api_error import ApiError
from server.chat_prompt import chat_prompt_ids
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.responses import TokenText


def tokenize_router(need_tokenizer: Callable[[], Tokenizer],
                    check_model: Callable[[TokenizeRequest | DetokenizeRequest], None],
                    max_model_len: Callable[[], int | None]) -> APIRouter:
    """The routes; need_tokenizer raises the api's 400 for a model without a tokenizer."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req)
        tok = need_tokenizer()
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await chat_prompt_ids(tok, req.messages, tools, req.chat_template_kwargs,
                                        req.add_generation_prompt, req.continue_final_message, req.documents)
        else:
            try:
                ids = await asyncio.to_thread(tok.encode, req.text, req.adds_special_tokens)
            except TokenizerError as e:
                field = "prompt" if req.prompt is not None else "content"
                raise ApiError(400, f"{field}: {e}", param=field) from None
        pieces = list(map(TokenText(tok), ids)) if req.with_pieces or req.return_token_strs else []
        tokens: list = [{"id": t, "piece": p} for t, p in zip(ids, pieces)] if req.with_pieces else ids
        return {"count": len(ids), "max_model_len": max_model_len(), "tokens": tokens,
                "token_strs": pieces if req.return_token_strs else None}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req)
        tok = need_tokenizer()
        if bad := [t for t in req.tokens if not 0 <= t < tok.vocab_size]:
            raise ApiError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {tok.vocab_size})",
                           param="tokens")
        text = await asyncio.to_thread(tok.decode, req.tokens, False)
        return {"prompt": text, "content": text}

    @router.get("/version")
    async def version():
        return {"version": hybrid.__version__}

    return router
