"""The FastAPI application: OpenAI routes with SSE streaming, /health, /status, /metrics and the chat page."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid.experts.process.liveness import is_stopped
from hybrid.invalid_request import InvalidRequest, lone_surrogate_at
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.engine_client import EngineClient, EngineError
from hybrid.managers.messages import TokenDelta, as_json
from hybrid.request_checks import (
    RequestLimits,
    check_min_tokens,
    check_prompt,
    check_token_ids,
    resolve_max_tokens,
)
from hybrid.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from hybrid.structured_output.backend import GrammarError
from hybrid.structured_output.grammar_checker import GrammarChecker
from hybrid.structured_output.grammars import check_schema
from hybrid.structured_output.tool_formats import format_for
from hybrid.tokenizer import Tokenizer, TokenizerError
from server.api_error import ApiError, error_response
from server.chat_prompt import chat_prompt_ids
from server.guard import RequestGuard
from server.metrics import Metrics
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    error_body,
    now,
    usage,
)
from server.responses import ChatShape, CompletionShape, ResponseShape, TokenText
from server.tokenize_routes import tokenize_router

STATIC_DIR = Path(__file__).parent / "static"
# The page runs only its own scripts: even HTML that got past the sanitizer cannot run inline script.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
            "base-uri 'none'; frame-ancestors 'none'")
RETRY_AFTER_S = 2
DISCONNECT_POLL_S = 0.25
log = logging.getLogger(__name__)


# Parts of a validation error's location that name a branch of a union (`str`, `list[dict[any,any]]`), not a field.
_UNION_BRANCHES = {"str", "int", "float", "bool", "none", "list", "dict"}


def _validation_error(err: dict) -> ApiError:
    """One pydantic error of a request body as a 400 naming the field (or saying what is wrong with the body)."""
    parts = [str(x) for x in err.get("loc", ()) if x != "body"]
    loc = ".".join(p for p in parts if p not in _UNION_BRANCHES and "[" not in p)
    loc = loc or err.get("ctx", {}).get("param", "")
    kind = err.get("type")
    if kind == "json_invalid":  # FastAPI puts the decoder's position after "body" in the location
        at = f" at character {parts[0]}" if parts else ""
        return ApiError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
                             f"{at}")
    if not loc and kind == "missing":
        return ApiError(400, "the request has no body: send a JSON object (Content-Type: application/json)")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return ApiError(400, "the request body must be a JSON object sent as Content-Type: application/json")
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    return ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class Admissions:
    """Requests admitted and not yet ended, bounded: counted when admitted (not when their stream starts), so a
    burst cannot overshoot. The event loop runs take() without awaiting, which makes it atomic."""

    def __init__(self, bound: int):
        self.bound, self.count = bound, 0

    def take(self, n: int = 1) -> bool:
        """Admits n sequences (a request's choices) together, or none."""
        if self.count + n > self.bound:
            return False
        self.count += n
        return True

    def give_back(self, n: int = 1) -> None:
        self.count -= n


class EndingStream(StreamingResponse):
    """A stream whose request is ended (admission given back, outcome recorded) even if the client leaves
    before its first chunk, when the body generator never starts and so never runs its finally."""

    def __init__(self, content, stats: "RequestStats", **kw):
        super().__init__(content, **kw)
        self.stats = stats

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stats.end("abort")


class RequestStats:
    """One request's timings as the client sees them, recorded into the metrics when it ends; a request with
    `n` choices counts each choice's tokens (its prompt once, as OpenAI's usage does)."""

    def __init__(self, metrics: Metrics, prompt_tokens: int, on_end: Callable[[], None]):
        self.metrics, self.prompt_tokens, self.on_end = metrics, prompt_tokens, on_end
        self.ended = False
        self.cached_tokens = 0
        self.start = time.perf_counter()
        self.first: float | None = None
        self.choice_tokens: dict[int, int] = {}
        metrics.prompt_tokens.inc(prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(self.choice_tokens.values())

    def token(self, msg: TokenDelta, choice: int = 0) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.observe(self.first - self.start)
            self.cached_tokens = msg.cached_tokens
            self.metrics.prefix_queried.inc(self.prompt_tokens)
            self.metrics.prefix_hits.inc(msg.cached_tokens)
        self.metrics.generation_tokens.inc(msg.completion_tokens - self.choice_tokens.get(choice, 0))
        self.choice_tokens[choice] = msg.completion_tokens

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def end(self, outcome: str) -> None:
        """Records the outcome and gives back the request's admission; only the first call counts."""
        if self.ended:
            return
        self.ended = True
        self.on_end()
        end = time.perf_counter()
        if outcome in ("stop", "length"):
            self.metrics.e2e.observe(end - self.start)
            longest = max(self.choice_tokens.values(), default=0)  # choices run side by side
            if self.first is not None and longest > 1:
                self.metrics.tpot.observe((end - self.first) / (longest - 1))
        self.metrics.finished(outcome)


def build_app(config: DaemonConfig, client: EngineClient, tokenizer: Tokenizer | None) -> FastAPI:
    name = config.model_name
    metrics = Metrics(name)
    max_pending = config.engine_config().max_num_seqs + config.max_queue
    admitted = Admissions(max_pending)
    token_text = TokenText(tokenizer)
    tool_format = format_for(tokenizer.hf.chat_template, tokenizer.added_tokens) if tokenizer else None

    def grammar_backend():
        from hybrid.structured_output.llguidance_backend import LLGuidanceBackend

        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return LLGuidanceBackend(tokenizer, client.state.info.vocab_size, eos)

    grammars = GrammarChecker(grammar_backend)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await client.start()
        yield
        await client.close()

    app = FastAPI(title="hybridd", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(RequestGuard, key_sha256=config.api_key_sha256, bind_host=config.host,
                       max_body_bytes=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return error_response(_validation_error(e.errors()[0]))

    @app.exception_handler(Exception)
    async def _failed(_: Request, e: Exception):  # uvicorn logs the traceback
        return error_response(ApiError(500, f"the server failed on this request ({type(e).__name__}); it goes on "
                                        "serving others, and its log has the details"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(ApiError(e.status_code, str(e.detail)))

    def check_model(req: SamplingFields | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this daemon serves {name!r}",
                           param="model", code="model_not_found")

    def check_ready() -> None:
        if not client.ready:
            raise ApiError(503, client.state.describe(), headers={"Retry-After": str(RETRY_AFTER_S)})

    async def check_schemas(req: SamplingFields) -> None:
        """The request's JSON schemas against the meta-schema, on a worker thread: a large one takes a good part
        of a second, which on the event loop would stall every stream."""
        def check() -> None:
            for param, where, schema in req.schemas():
                try:
                    check_schema(schema, where)
                except GrammarError as e:
                    raise ApiError(400, f"{param}: {e}", param=param) from None

        await asyncio.to_thread(check)

    async def check_grammar(grammar: str | None, param: str) -> None:
        """A grammar the model's tokenizer cannot compile is the request's fault (its schema, say)."""
        if grammar is None:
            return
        if tokenizer is None:
            raise ApiError(400, f"{param}: structured output needs the model's tokenizer, and it has none",
                           param=param)
        check_ready()
        if (at := lone_surrogate_at(grammar)) is not None:
            raise ApiError(400, f"{param}: holds a lone surrogate ({grammar[at]!r}): text that is not valid Unicode",
                           param=param)
        try:
            await asyncio.to_thread(grammars.check, grammar)
        except GrammarError as e:
            raise ApiError(400, f"{param}: cannot be enforced: {e}", param=param) from None

    def bad_words_ids(words: list[str]) -> list[list[int]]:
        """The bad words in tokens: each as it reads at the start of a text, and after a space where vLLM adds
        that spelling."""
        if words and tokenizer is None:
            raise ApiError(400, "bad_words: needs the model's tokenizer, and this model has none", param="bad_words")
        out = []
        for word in words:  # none is blank (the request's validation)
            try:
                spellings = tokenizer.word_ids(word)
            except TokenizerError as e:
                raise ApiError(400, f"bad_words: {e}", param="bad_words") from None
            for ids in spellings:
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ApiError(400, f"bad_words: {word[:32]!r} is {len(ids)} tokens, more than the "
                                   f"{MAX_BAD_WORD_TOKENS} a bad word may have", param="bad_words")
                out.append(ids)
        return out

    def admit(req: SamplingFields, prompts: list[list[int]], prompt_field: str,
              grammar: str | None = None) -> tuple[list[list[int]], list[SamplingParams], RequestStats]:
        """The prompt (cut to truncate_prompt_tokens) and sampling parameters of each of the request's choices (`n`
        per prompt, prompt by prompt), once the request is checked and admitted."""
        check_ready()
        info = client.state.info
        limits = RequestLimits(info.vocab_size, info.max_model_len)
        choices: list[tuple[list[int], SamplingParams]] = []
        bad_words = bad_words_ids(req.bad_words)
        try:
            prompts = [req.truncated(prompt_ids, limits.max_model_len) for prompt_ids in prompts]
            for prompt_ids in prompts:
                check_prompt(prompt_ids, limits, prompt_field)
                max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt_ids), limits,
                                                req.default_max_tokens)
                check_min_tokens(req.min_tokens, max_tokens)
                choices += [(prompt_ids, req.sampling_params(max_tokens, grammar, j, bad_words))
                            for j in range(req.n)]
            check_token_ids(choices[0][1], limits)
        except InvalidRequest as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        if not admitted.take(len(choices)):
            metrics.finished("rejected")
            raise ApiError(503, f"the server is busy: {admitted.count} requests are queued or running; retry "
                           "shortly", headers={"Retry-After": str(RETRY_AFTER_S)})
        stats = RequestStats(metrics, sum(map(len, prompts)), lambda: admitted.give_back(len(choices)))
        return [c[0] for c in choices], [c[1] for c in choices], stats

    def shown_tokens(req: SamplingFields) -> TokenText:
        """How logprobs name tokens: by their text, or with vLLM's return_tokens_as_token_ids as token_id:N."""
        return TokenText(tokenizer, as_ids=True) if req.return_tokens_as_token_ids else token_text

    def need_tokenizer() -> Tokenizer:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids to /v1/completions")
        return tokenizer

    async def deltas(prompts: list[list[int]], params: list[SamplingParams],
                     shapes: list[ResponseShape]) -> AsyncIterator[tuple[ResponseShape, TokenDelta]]:
        """Each choice's deltas as the engine sends them, with the choice's shape; the first failure of any
        choice ends them all (the others are aborted in the engine)."""
        if len(shapes) == 1:
            async with aclosing(client.generate(shapes[0].rid, prompts[0], params[0])) as gen:
                async for msg in gen:
                    yield shapes[0], msg
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_ids: list[int], p: SamplingParams, shape: ResponseShape) -> None:
            try:
                async with aclosing(client.generate(f"{shape.rid}-{shape.index}", prompt_ids, p)) as gen:
                    async for msg in gen:
                        queue.put_nowait((shape, msg))
            except Exception as e:
                queue.put_nowait((shape, e))
            finally:
                queue.put_nowait((shape, None))

        tasks = [asyncio.create_task(pump(*choice)) for choice in zip(prompts, params, shapes)]
        try:
            running = len(tasks)
            while running:
                shape, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield shape, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(request: Request, stream: bool, prompts: list[list[int]], params: list[SamplingParams],
                  stats: RequestStats, shapes: list[ResponseShape], include_usage: bool) -> Response:
        """Streams the choices' SSE chunks or returns the whole body; the shapes' `rid` names the request in the
        response id and (with the choice's index, when there are several) in the engine."""
        for index, shape in enumerate(shapes):
            shape.index = index
        first = shapes[0]

        async def events() -> AsyncIterator[str]:
            outcome = "abort"
            try:
                for shape in shapes:
                    if (opening := shape.opening()) is not None:
                        yield _sse(opening)
                async with aclosing(deltas(prompts, params, shapes)) as gen:
                    async for shape, msg in gen:
                        stats.token(msg, shape.index)
                        if (body := shape.chunk(msg)) is not None:
                            yield _sse(body)
                outcome = first.finish_reason or "abort"
                if include_usage:
                    yield _sse(first.usage_chunk(stats.usage()))
                yield _sse("[DONE]")
            except EngineError as e:
                outcome = "error"
                yield _sse(error_body(str(e), e.status))
                yield _sse("[DONE]")
            except Exception as e:  # the stream has begun: the error can only be an event
                log.exception("request %s failed mid-stream", first.rid)
                outcome = "error"
                yield _sse(error_body(f"the server failed on this request ({type(e).__name__})", 500))
                yield _sse("[DONE]")
            finally:
                stats.end(outcome)

        if stream:
            return EndingStream(events(), stats, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> None:
            async with aclosing(deltas(prompts, params, shapes)) as gen:
                async for shape, msg in gen:
                    stats.token(msg, shape.index)
                    shape.add(msg)

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    return Response(status_code=499)
            try:
                task.result()
            except EngineError as e:
                stats.end("error")
                raise ApiError(e.status, str(e)) from None
            stats.end(first.finish_reason)
        finally:
            task.cancel()
            stats.end("abort")
        totals = stats.usage()
        body = first.final(totals)
        body["choices"] += [c for shape in shapes[1:] for c in shape.final(totals)["choices"]]
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req)
        tok = need_tokenizer()
        if req.calls_tools and tool_format is None:
            raise ApiError(400, "tools: this model's chat template has no tool-call format hybridd reads "
                           "(Hermes/Qwen3 <tool_call> or DeepSeek-V3)", param="tools")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.calls_tools else None
        await check_schemas(req)
        grammar, param = req.constraint or (None, "")
        if (forced := req.forced_functions) is not None:
            grammar, param = tool_format.grammar(forced, req.parallel_tool_calls), "tools"
        await check_grammar(grammar, param)
        prompt_ids = await chat_prompt_ids(tok, req.messages, tools, req.chat_template_kwargs,
                                           req.add_generation_prompt, req.continue_final_message, req.documents)
        prompts, params, stats = admit(req, [prompt_ids], "messages", grammar)
        rid, created = uuid.uuid4().hex, now()
        shapes = [ChatShape(rid, name, created, shown_tokens(req), params[0].logprobs is not None,
                            tool_format if req.calls_tools else None, req.parallel_tool_calls, req.echoed,
                            req.prompt_logprobs, prompts[0] if req.return_token_ids else None) for _ in params]
        return await run(request, req.stream, prompts, params, stats, shapes, req.include_usage)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)
        texts = req.prompts
        try:
            encoded = [await asyncio.to_thread(need_tokenizer().encode, p, req.add_special_tokens)
                       if isinstance(p, str) else list(p) for p in texts]
        except TokenizerError as e:
            raise ApiError(400, str(e), param="prompt") from None
        await check_schemas(req)
        grammar, param = req.constraint or (None, "")
        await check_grammar(grammar, param)
        prompts, params, stats = admit(req, encoded, "prompt", grammar)
        encoded = prompts[::req.n]  # as admitted: truncated to truncate_prompt_tokens
        echoes: list[str | None] = [None] * len(texts)
        if req.echo:  # a truncated prompt is echoed as the model read it
            echoes = ["" if req.truncate_prompt_tokens is not None or not isinstance(p, str) else p for p in texts]
            if tokenizer is not None:
                echoes = [e or await asyncio.to_thread(tokenizer.decode, ids, False) for e, ids in zip(echoes, encoded)]
        rid, created = uuid.uuid4().hex, now()
        shapes = [CompletionShape(rid, name, created, shown_tokens(req), req.logprobs, echo, ids, req.prompt_logprobs,
                                  req.return_token_ids)
                  for ids, echo in zip(encoded, echoes) for _ in range(req.n)]  # admit's order of choices
        return await run(request, req.stream, prompts, params, stats, shapes, req.include_usage)

    def max_model_len() -> int | None:
        return client.state.info.max_model_len if client.state.info else None

    app.include_router(tokenize_router(need_tokenizer, check_model, max_model_len))

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, max_model_len=max_model_len())]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this daemon serves {name!r}",
                           param="model", code="model_not_found")
        return ModelCard(id=name, max_model_len=max_model_len()).model_dump()

    def expert_pid() -> int | None:
        s = client.state
        return (s.stats.expert_pid if s.stats else None) or (s.info.expert_pid if s.info else None)

    @app.get("/health")
    async def health():
        s = client.state
        if s.status == "ready" and is_stopped(pid := expert_pid()):
            body = {"status": "degraded", "reason": f"the expert process (pid {pid}) is stopped and cannot serve; "
                    "the engine restarts it at its next call"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        if s.status == "ready":
            return {"status": "ok", "model": name}
        body = {"status": s.status, "reason": s.reason, "progress": as_json(s.progress) or {}}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/status")
    async def status():
        s = client.state
        return {"model": name, "status": s.status, "reason": s.reason, "engine_pid": s.pid, "restarts": s.restarts,
                "info": as_json(s.info) or {}, "stats": as_json(s.stats) or {}, "progress": as_json(s.progress) or {},
                "pending": admitted.count, "experts": "stopped" if is_stopped(expert_pid()) else "ok",
                "max_pending": max_pending, "url": config.url, "api_pid": os.getpid(),
                "engines": {role: {"pid": e.pid, "status": e.status, "reason": e.reason, "restarts": e.restarts,
                                   "stats": as_json(e.stats) or {}} for role, e in client.engines.items()}}

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render({role: e.stats for role, e in client.engines.items()}, admitted.count, client.ready)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    return app

