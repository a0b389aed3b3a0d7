"""`hybridd generate`: complete one prompt in this process and exit (text, or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from hybrid.cli.engine_args import add_engine_args, engine_kwargs, explain_gpus, follow_if_not_rank0, parse_gpus
from hybrid.sampling_params import SamplingParams
from hybrid.tokenizer import TokenizerError, load_chat_template


def register(sub) -> None:
    g = sub.add_parser("generate", help="complete one prompt and exit")
    add_engine_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, comma-separated")
    g.add_argument("--gpus", type=parse_gpus, help="hybrid path: attention, KV and dense layers on this CUDA "
                   "device, routed experts in the expert process (with --attn-device cpu: the CPU plays the GPU)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--chat-template", help="with --chat: a Jinja chat template (a file, or the text itself) "
                   "replacing the model's")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the top one")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens already in prompt or completion")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times how often a token was generated")
    g.add_argument("--min-tokens", type=int, default=0, help="no end of sequence or stop before this many tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object with ids, text and timings")
    g.set_defaults(func=cmd_generate)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def cmd_generate(a: argparse.Namespace) -> int:
    from hybrid.llm import DEFAULT_MODEL_DIR, LLM

    if follow_if_not_rank0(a, a.model or DEFAULT_MODEL_DIR):
        return 0
    # The request's own flags are checked before the model loads, which takes minutes for a large one.
    if a.prompt_ids is not None and a.chat:
        raise ValueError("--chat needs --prompt text, not --prompt-ids")
    if a.chat_template and not a.chat:
        raise ValueError("--chat-template renders --chat prompts: give --chat too")
    chat_template = load_chat_template(a.chat_template) if a.chat_template else None
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos, min_p=a.min_p,
                            repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                            frequency_penalty=a.frequency_penalty, min_tokens=a.min_tokens)
    llm = LLM(a.model, **engine_kwargs(a))
    explain_gpus(a.gpus, a.slp_threshold)
    engine = llm.engine
    if a.prompt_ids is not None:
        prompt = a.prompt_ids
    elif a.chat:
        if engine.tokenizer is None:
            raise TokenizerError("this model has no tokenizer, so --chat is unavailable")
        if chat_template is not None:
            engine.tokenizer.use_chat_template(chat_template)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
    else:
        prompt = a.prompt
    rid = engine.add_request(prompt, params)
    final = None
    try:
        while final is None:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if not a.json:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
                if out.finished:
                    final = out
    finally:
        engine.close()
    if final.error is not None:
        print(f"hybridd: error: {final.error}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({
            "token_ids": final.token_ids, "text": final.text, "prompt_tokens": len(final.prompt_token_ids),
            "ttft_s": final.ttft_s, "tpot_s": final.tpot_s, "finish_reason": final.finish_reason,
            "cached_tokens": final.num_cached_tokens, "streamed_bytes": final.streamed_bytes,
        }))
    else:
        sys.stdout.write("\n")
        n = len(final.token_ids)
        tps = 1.0 / final.tpot_s if final.tpot_s else float("nan")
        print(f"[{len(final.prompt_token_ids)} prompt tokens, {n} generated, finish={final.finish_reason}, "
              f"ttft {final.ttft_s:.3f}s, {tps:.1f} tok/s decode]", file=sys.stderr)
    return 0
