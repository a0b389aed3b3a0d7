"""Structured output and tools: grammars enforced in the sampler (engine), tool-call formats parsed whole and
streamed, and the OpenAI surface (response_format, tools, tool_choice; vLLM's structured_outputs and guided_*
fields, llama-server's json_schema and grammar) through a daemon with the openai client."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import numpy as np
import pytest
from daemon_harness import MODEL

from hybrid.llm import LLM
from hybrid.sampling_params import SamplingParams
from hybrid.structured_output.backend import (
    EOS_RANK,
    GrammarBackend,
    closing_ranks,
    first_token,
    pack_bits,
    unpack_bits,
)
from hybrid.structured_output.grammars import json_object_grammar, json_schema_grammar
from hybrid.structured_output.tool_formats import (
    DeepSeekV3Format,
    Function,
    HermesFormat,
    ToolCallStream,
    format_for,
)

SCHEMAS = {
    "bounded": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum-array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
                  "maxItems": 3}}, "required": ["color", "sizes"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["id", "ok", "tags"]},
        "score": {"type": "number"}}, "required": ["user", "score"]},
    "free-string": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    "top-level-array": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2},
}
WEATHER = Function("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]})
ADD = Function("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False})
NOW = Function("now", None)
FUNCTIONS = {f.name: f for f in (WEATHER, ADD, NOW)}


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-deepseek-v3"])
def llm(request, model_dirs):
    engine = LLM(model_dirs[request.param], dtype="float32", max_num_seqs=8)
    yield engine
    engine.close()


def tool_format(llm):
    return format_for(llm.tokenizer.hf.chat_template, llm.tokenizer.added_tokens)


def check_call(call) -> None:
    fn = FUNCTIONS[call.name]
    args = json.loads(call.arguments)
    jsonschema.validate(args, fn.parameters or {"type": "object", "maxProperties": 0})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_from_random_weights(llm, temperature):
    prompts = ["Answer in JSON:", "{", "Tell me a story."]
    for name, schema in SCHEMAS.items():
        for prompt in prompts:
            out = llm.generate(prompt, SamplingParams(max_tokens=96, temperature=temperature, seed=3,
                                                      grammar=json_schema_grammar(schema)))[0]
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), schema)


def test_json_object_closes_within_a_small_budget(llm):
    for max_tokens in (8, 24, 64):
        out = llm.generate("JSON please", SamplingParams(max_tokens=max_tokens, temperature=0,
                                                         grammar=json_object_grammar()))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_and_validate(llm, parallel):
    fmt = tool_format(llm)
    assert isinstance(fmt, HermesFormat if "<tool_call>" in llm.tokenizer.hf.chat_template else DeepSeekV3Format)
    for chosen in ([WEATHER], [ADD], [NOW], [WEATHER, ADD, NOW]):
        for temperature in (0.0, 1.0):
            out = llm.generate("Use a tool.", SamplingParams(max_tokens=160, temperature=temperature, seed=5,
                                                             grammar=fmt.grammar(chosen, parallel)))[0]
            content, calls = fmt.split(out.text)
            assert out.finish_reason == "stop" and content == "" and calls, out.text
            assert parallel or len(calls) == 1
            for call in calls:
                assert call.name in {f.name for f in chosen}
                check_call(call)


def wait_for_mask_process(llm, timeout_s: float = 120.0) -> None:
    """Runs small constrained requests until the engine's mask process is up (it starts at the first one)."""
    deadline = time.monotonic() + timeout_s
    params = SamplingParams(max_tokens=2, temperature=0, grammar=json_object_grammar())
    while not llm.engine.sampler.masks.process_ready:
        assert time.monotonic() < deadline, "the mask process did not come up"
        llm.generate("{", params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mask_process_and_engine_thread_draw_the_same_tokens(llm, model_dirs, temperature):
    """The same batch constrained by masks from the mask process and by masks computed on the engine thread:
    same tokens, including the closing phase (max_tokens 60 is inside its horizon from the start)."""
    wait_for_mask_process(llm)
    prompts = ["JSON:", "Once upon a time", "{", "Tell me a story."]
    params = [SamplingParams(max_tokens=60, temperature=temperature, seed=i,
                             grammar=json_schema_grammar(SCHEMAS[name]))
              for i, name in enumerate(["nested", "bounded", "free-string", "enum-array"])]
    from_process = [o.token_ids for o in llm.generate(prompts, params)]
    inline = LLM(llm.engine.config.model, dtype="float32", max_num_seqs=8, grammar_masks="inline")
    try:
        assert [o.token_ids for o in inline.generate(prompts, params)] == from_process
        assert inline.engine.sampler.masks.process_pid is None
    finally:
        inline.close()


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate("Once upon a time", free)[0]
    constrained = SamplingParams(max_tokens=48, temperature=0, grammar=json_schema_grammar(SCHEMAS["bounded"]))
    outs = llm.generate(["Once upon a time", "JSON:", "Once upon a time"], [free, constrained, free])
    assert outs[0].token_ids == alone.token_ids == outs[2].token_ids
    jsonschema.validate(json.loads(outs[1].text), SCHEMAS["bounded"])


def test_grammar_that_does_not_compile_fails_only_its_request(llm):
    engine = llm.engine
    bad = engine.add_request("x", SamplingParams(max_tokens=4, grammar='start: %json {"type": "integr"}'))
    good = engine.add_request("x", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[bad].finish_reason == "error" and done[bad].error_status == 400 and "integr" in done[bad].error
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 4


def test_tool_results_flow_back_into_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain, 4 degrees"}]
    text = llm.tokenizer.decode(llm.tokenizer.apply_chat_template(messages, tools), skip_special_tokens=False)
    assert "get_weather" in text.split("Weather in Oslo?")[0]  # the tool section precedes the conversation
    assert '"city": "Oslo"' in text and "rain, 4 degrees" in text
    fmt = tool_format(llm)
    assert [c.name for c in fmt.split(text[text.rindex(fmt.start):])[1]] == ["get_weather"]


def test_mask_bits_match_the_library(llm):
    from hybrid.structured_output.llguidance_backend import LLGuidanceBackend

    tok = llm.tokenizer
    vocab = llm.engine.model_config.vocab_size
    backend = LLGuidanceBackend(tok, vocab, [tok.eos_token_id])
    m = backend.matcher(json_schema_grammar(SCHEMAS["enum-array"]))
    allowed = unpack_bits(backend.bitmask([m]), vocab)[0]
    texts = tok.hf.batch_decode([[i] for i in range(len(tok.hf))])
    assert allowed.any() and all(texts[i].startswith("{") for i in np.flatnonzero(allowed))
    assert first_token(backend.bitmask([m])[0]) == np.flatnonzero(allowed)[0]
    assert m.accept(tok.encode("{")[-1])
    assert not unpack_bits(backend.bitmask([m]), vocab)[0][tok.eos_token_id]


class Ranked(GrammarBackend):
    """A backend of fixed closing ranks, for its closing()."""

    check = matcher = None

    def __init__(self, ranks: np.ndarray):
        self.closing_rank, self.vocab_size = ranks, len(ranks)


def test_closing_ranks():
    ranks = closing_ranks(['"', "ab", ",", "}]", "</tool_call>", "<tool_call>", "x", '"}', "].", " ]"],
                          {"</tool_call>", "<tool_call>"}, [6], 10)
    assert ranks.tolist() == [3, 0, 1, 2, 2, 0, 4, 3, 0, 2]
    allowed = np.array([[False, True, True, False, False, True, False, False, True, False],
                        [True, True, False, False, False, False, True, True, False, False],
                        [False] * 10])
    assert unpack_bits(Ranked(ranks).closing(pack_bits(allowed)), 10).tolist() == [
        [False, False, True] + [False] * 7, [False] * 6 + [True] + [False] * 3, [False] * 10]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 2048, 5000])
def test_closing_keeps_the_allowed_tokens_of_the_highest_rank_present(vocab):
    rng = np.random.default_rng(vocab)
    backend = Ranked(rng.integers(0, EOS_RANK + 1, vocab).astype(np.int8))
    allowed = rng.random((40, vocab)) < rng.choice([0.0005, 0.01, 0.5], size=(40, 1))
    got = unpack_bits(backend.closing(pack_bits(allowed)), vocab).astype(bool)
    for row, flags in zip(allowed, got):
        top = backend.closing_rank[row].max(initial=-1)
        assert np.array_equal(flags, row & (backend.closing_rank == top))
        assert first_token(pack_bits(flags[None])[0]) == (np.flatnonzero(flags)[0] if flags.any() else None)


@pytest.mark.parametrize("fmt_cls,text", [
    (HermesFormat, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
                   '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    (DeepSeekV3Format, "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                       '```json\n{"city": "Oslo", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
                       "function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
])
def test_tool_call_stream_agrees_with_whole_text(fmt_cls, text):
    fmt = fmt_cls(set())
    content, calls = fmt.split(text)
    assert content.rstrip() == "Let me check." and [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "celsius"}
    for step in (1, 2, 3, 7, len(text)):
        stream, got_content, got_calls = ToolCallStream(fmt), "", []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            c, new = stream.feed(piece, i == len(pieces) - 1)
            got_content += c
            got_calls += new
            assert fmt.start[:2] not in c  # nothing of the marker leaks into content
        assert got_content == content and [(c.name, c.arguments) for c in got_calls] == \
            [(c.name, c.arguments) for c in calls]


def test_arguments_keep_the_models_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"big": 1e999, "n": 12345678901234567890123}}\n</tool_call>'
    assert HermesFormat(set()).split(text)[1][0].arguments == '{"big": 1e999, "n": 12345678901234567890123}'
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": 1.50}\n```"
            "<｜tool▁call▁end｜>")
    assert DeepSeekV3Format(set()).split(text)[1][0].arguments == '{"x": 1.50}'


def test_malformed_tool_section_is_content():
    fmt = HermesFormat(set())
    text = "ok <tool_call>\n{not json}\n</tool_call>"
    assert fmt.split(text) == (text, [])
    stream = ToolCallStream(fmt)
    assert stream.feed(text[:8], False) == ("ok ", []) and stream.feed(text[8:], True) == (text[3:], [])
    assert ToolCallStream(fmt).feed("a <tool", True) == ("a <tool", [])


# ---------------------------------------------------------------- through the daemon, with the openai client

def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], **kw)


def streamed(client, **kw) -> tuple[str, list[dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_api_json_schema_validates_and_streams_alike(client, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    whole = chat(client, response_format=fmt, max_tokens=96, temperature=0)
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMAS[name])
    assert whole.choices[0].finish_reason == "stop"
    content, calls, reason = streamed(client, response_format=fmt, max_tokens=96, temperature=0)
    assert (content, calls, reason) == (whole.choices[0].message.content, [], "stop")


def test_api_json_object_on_chat_and_completions(client):
    out = chat(client, response_format={"type": "json_object"}, max_tokens=64, temperature=0.8, seed=1)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    comp = client.completions.create(model=MODEL, prompt="data:", max_tokens=64, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(comp.choices[0].text), dict)


API_TOOLS = [{"type": "function", "function": {"name": f.name, "description": f"the {f.name} tool",
                                               **({"parameters": f.parameters} if f.parameters else {})}}
             for f in (WEATHER, ADD, NOW)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_api_forced_tool_calls(client, choice):
    kw = dict(tools=API_TOOLS, tool_choice=choice, max_tokens=160, temperature=0)
    out = chat(client, **kw)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls and msg.content is None
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function)
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["add"]
    content, calls, reason = streamed(client, **kw)
    assert reason == "tool_calls" and content == ""
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]


def test_api_tool_conversation_round_trip(client):
    first = chat(client, tools=API_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "Hello"}, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=API_TOOLS, max_tokens=8,
                                            temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_api_constrained_and_free_in_one_batch(daemon, client):
    import concurrent.futures as cf

    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    with cf.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(chat, client, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}) if i % 2 else
                pool.submit(chat, client, response_format=fmt, max_tokens=96, temperature=0) for i in range(4)]
        outs = [j.result() for j in jobs]
    for i, out in enumerate(outs):
        if i % 2:
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 40
        else:
            jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS["nested"])


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "integr"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "missing"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": API_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
      "tool_choice": "required"}, "properties"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
    ({"tools": API_TOOLS, "tool_choice": "auto", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_api_bad_schemas_and_tool_choices_are_400(daemon, body, needle):
    r = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_shape_turns_auto_tool_calls_into_openai_chunks():
    """tool_choice auto: the model wrote a call unprompted; stream chunks and the whole body carry it alike."""
    from hybrid.managers.messages import TokenDelta
    from server.responses import ChatShape, TokenText

    text = 'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    deltas = [TokenDelta("r", [i], p, i == len(pieces) - 1, "stop" if i == len(pieces) - 1 else None, 3, i + 1)
              for i, p in enumerate(pieces)]
    stream = ChatShape("r", MODEL, 0, TokenText(None), False, HermesFormat(set()))
    chunks = [c for d in deltas if (c := stream.chunk(d)) is not None]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert content == "Checking.\n" and [(c["index"], c["function"]["name"]) for c in calls] == [(0, "now")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = ChatShape("r", MODEL, 0, TokenText(None), False, HermesFormat(set()))
    for d in deltas:
        whole.add(d)
    body = whole.final({})
    message = body["choices"][0]["message"]
    assert message["content"] == "Checking.\n" and message["tool_calls"][0]["function"] == calls[0]["function"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    plain = ChatShape("r", MODEL, 0, TokenText(None), False, HermesFormat(set()))
    plain.add(TokenDelta("r", [1], "no tools here", True, "stop", 3, 1))
    body = plain.final({})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "no tools here"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_parallel_tool_calls_false_releases_the_first_call_only():
    from hybrid.managers.messages import TokenDelta
    from server.responses import ChatShape, TokenText

    text = ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "later", "arguments": {}}\n</tool_call>')
    for parallel, names in ((True, ["now", "later"]), (False, ["now"])):
        shape = ChatShape("r", MODEL, 0, TokenText(None), False, HermesFormat(set()), parallel)
        shape.add(TokenDelta("r", [1], text, True, "stop", 3, 1))
        message = shape.final({})["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names


def test_api_tool_choice_none_hides_tools(client):
    with_tools = chat(client, tools=API_TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    without = chat(client, max_tokens=4, temperature=0)
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    auto = chat(client, tools=API_TOOLS, max_tokens=4, temperature=0)
    assert auto.usage.prompt_tokens > without.usage.prompt_tokens  # the template's tool section


def test_the_api_compiles_each_grammar_once_and_keeps_a_bounded_cache_of_verdicts(monkeypatch):
    from hybrid.structured_output import grammar_checker
    from hybrid.structured_output.backend import GrammarError
    from hybrid.structured_output.grammar_checker import GrammarChecker

    compiled = []

    class Backend:
        def check(self, grammar: str) -> None:
            compiled.append(grammar)
            if "bad" in grammar:
                raise GrammarError(f"cannot compile {grammar}")

    monkeypatch.setattr(grammar_checker, "CACHED_VERDICTS", 2)
    checker = GrammarChecker(Backend)
    for grammar in ("a", "bad", "a", "bad"):
        if "bad" in grammar:
            with pytest.raises(GrammarError, match="cannot compile bad"):
                checker.check(grammar)
        else:
            checker.check(grammar)
    assert compiled == ["a", "bad"]
    checker.check("c")  # evicts the least recently used verdict ("a")
    with pytest.raises(GrammarError):
        checker.check("bad")
    checker.check("a")
    assert compiled == ["a", "bad", "c", "a"]


def test_a_tokenizer_the_grammar_library_cannot_read_fails_grammars_not_the_engine(tmp_path, caplog):
    """A tokenizer.json without a decoder loads and serves free requests, but llguidance cannot read its tokens:
    each constrained request fails with a 400 naming the tokenizer (the backend is not rebuilt per request), the
    api's check refuses every grammar the same way (trying the tokenizer once), and free requests go on."""
    import shutil

    from hybrid.llm import DEFAULT_MODEL_DIR
    from hybrid.structured_output.backend import GrammarError
    from hybrid.structured_output.grammar_checker import GrammarChecker
    from hybrid.structured_output.llguidance_backend import LLGuidanceBackend
    from hybrid.tokenizer import Tokenizer

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["decoder"] = None
    (model / "tokenizer.json").write_text(json.dumps(spec))
    llm = LLM(str(model), max_num_seqs=2)
    try:
        for _ in range(2):
            out = llm.generate("x", SamplingParams(max_tokens=4, grammar=json_object_grammar()))[0]
            assert out.finish_reason == "error" and out.error_status == 400
            assert out.error.startswith("this model's tokenizer cannot be used for structured output: llguidance")
        assert caplog.text.count("structured output is unavailable on this model") == 1
        assert llm.generate("x", SamplingParams(max_tokens=3))[0].finish_reason == "length"
    finally:
        llm.close()
    made = []
    checker = GrammarChecker(lambda: made.append(1) or LLGuidanceBackend(Tokenizer(model), 2048, [0]))
    for grammar in (json_object_grammar(), 'start: "a"'):  # two grammars: the tokenizer is tried once
        with pytest.raises(GrammarError, match="cannot be used for structured output"):
            checker.check(grammar)
    assert made == [1]


# ------------------------------------------- vLLM's and llama-server's constraint fields, through the daemon

ITEM_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"]}
CONSTRAINED = [  # (body fields, check of the reply text)
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"regex": "(yes|no), [0-9]"}}, lambda t: re.fullmatch("(yes|no), [0-9]", t)),
    ({"guided_choice": ["red", 'say "hi"', "two\nlines"]}, lambda t: t in ("red", 'say "hi"', "two\nlines")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": ITEM_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), ITEM_SCHEMA) is None),
    ({"guided_json": json.dumps(ITEM_SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), ITEM_SCHEMA) is None),
    ({"structured_outputs": {"json": ITEM_SCHEMA}},
     lambda t: jsonschema.validate(json.loads(t), ITEM_SCHEMA) is None),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ({"json_schema": ITEM_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), ITEM_SCHEMA) is None),
    ({"response_format": {"type": "json_object", "schema": {"type": "array", "items": {"type": "boolean"},
                                                            "minItems": 2, "maxItems": 2}}},
     lambda t: len(json.loads(t)) == 2 and all(isinstance(x, bool) for x in json.loads(t))),
    ({"grammar": 'root ::= ("yes" | "no") " " digit digit\ndigit ::= [0-9]'},
     lambda t: re.fullmatch("(yes|no) [0-9][0-9]", t)),
    ({"guided_grammar": 'root ::= "SELECT " col " FROM t"\ncol ::= "id" | "name"'},
     lambda t: t in ("SELECT id FROM t", "SELECT name FROM t")),
    ({"guided_grammar": 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'}, lambda t: re.fullmatch("x=[1-9][0-9]?;", t)),
]


@pytest.mark.parametrize("fields,check", CONSTRAINED, ids=[next(iter(f)) for f, _ in CONSTRAINED])
def test_vllm_and_llama_server_constraints_hold_on_chat_stream_and_completions(daemon, client, fields, check):
    for temperature in (0, 1):
        out = chat(client, max_tokens=64, temperature=temperature, seed=3, extra_body=fields)
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop" and check(text), (fields, text)
    content, _, reason = streamed(client, max_tokens=64, temperature=0, seed=3, extra_body=fields)
    whole = chat(client, max_tokens=64, temperature=0, seed=3, extra_body=fields).choices[0].message.content
    assert (content, reason) == (whole, "stop")
    comp = client.completions.create(model=MODEL, prompt="answer:", max_tokens=64, temperature=0, extra_body=fields)
    assert comp.choices[0].finish_reason == "stop" and check(comp.choices[0].text), comp.choices[0].text


@pytest.mark.parametrize("body,needle", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex and guided_choice each constrain the reply"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "response_format and grammar"),
    ({"guided_regex": "(?=a)b"}, "guided_regex: cannot be enforced: "),
    ({"guided_regex": "a" * 300_000}, "guided_regex: longer than 256 K characters"),
    ({"guided_choice": []}, "guided_choice: needs at least one string"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar: neither Lark"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar: cannot be enforced: "),
    ({"guided_grammar": "start: start"}, "guided_grammar: cannot be enforced: no text can follow it"),
    ({"guided_json": {"$ref": "#"}}, "guided_json: cannot be enforced: no text can follow it"),
    ({"guided_regex": "a{1000000}"}, "the request's grammar cannot be followed further: lexer error"),
    ({"grammar": "   "}, "grammar: the grammar is empty"),
    ({"guided_json": "{not json"}, "guided_json: schema is a string but not JSON text"),
    ({"guided_json": {"type": "integr"}}, "guided_json: schema['type'] is not a valid JSON schema"),
    ({"json_schema": 7}, "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give exactly one of json, regex"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " *"}}, "whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "typo": 1}}, "structured_outputs.typo"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern: hybridd does not support"),
    ({"response_format": {"type": "json_schema", "schema": {"type": "string"},
                          "json_schema": {"name": "x", "schema": {}}}}, "json_schema.schema"),
    ({"tools": API_TOOLS, "guided_choice": ["a"]}, "guided_choice cannot be combined with tools"),
])
def test_api_bad_constraints_are_400_naming_the_field(daemon, body, needle):
    r = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_llama_server_empty_grammar_asks_for_nothing(daemon, client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                    extra_body={"grammar": "", "ignore_eos": True})
    free = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert out.choices[0].text == free.choices[0].text and out.usage.completion_tokens == 6
