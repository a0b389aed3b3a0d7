"""The `hybridd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hybrid.config import ConfigError
from hybrid.expert_client import ExpertServerError
from hybrid.expert_pack import PackError
from hybrid.loader import CheckpointError
from hybrid.sampling_params import SamplingParams
from hybrid.tokenizer import TokenizerError

USER_ERRORS = (ConfigError, CheckpointError, PackError, ExpertServerError, TokenizerError, ValueError,
               FileNotFoundError)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (checkpoint's), bfloat16, float32")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's, within the KV pool)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk / step token budget")
    p.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (default: sized from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--threads", type=int, help="compute threads (default: every allowed core)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "torch"],
                   help="cpu: C++ AVX-512 kernels for experts and dense layers; torch: the pure-torch reference")
    p.add_argument("--expert-format", default="auto", choices=["auto", "bf16", "fp8", "int8", "int4"],
                   help="routed-expert weights in RAM (auto: the checkpoint's, fp8 stays fp8)")
    p.add_argument("--dense-format", default="auto", choices=["auto", "bf16", "fp8", "int8"],
                   help="dense linear weights with the cpu backend (auto: the checkpoint's)")
    p.add_argument("--expert-pack", help="map the experts from this `hybridd pack` directory instead of packing")
    p.add_argument("--experts", default="inline", choices=["inline", "process"],
                   help="run the routed experts in this process or in the expert process")
    p.add_argument("--expert-server", help="control address of a running expert process (with --experts process)")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, num_kv_blocks=a.num_kv_blocks,
                kv_cache_bytes=int(a.kv_cache_gb * 2**30), backend=a.backend, expert_format=a.expert_format,
                dense_format=a.dense_format, num_threads=a.threads, expert_pack=a.expert_pack, experts=a.experts,
                expert_server=a.expert_server)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def cmd_generate(a: argparse.Namespace) -> int:
    import torch

    from hybrid.llm import LLM

    if a.threads and a.backend == "torch":
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, **_engine_kwargs(a))
    engine = llm.engine
    if a.prompt_ids is not None:
        if a.chat:
            raise ValueError("--chat needs --prompt text, not --prompt-ids")
        prompt = a.prompt_ids
    elif a.chat:
        if engine.tokenizer is None:
            raise TokenizerError("this model has no tokenizer, so --chat is unavailable")
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
    else:
        prompt = a.prompt
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos)
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
    if a.json:
        print(json.dumps({
            "token_ids": final.token_ids, "text": final.text, "prompt_tokens": len(final.prompt_token_ids),
            "ttft_s": final.ttft_s, "tpot_s": final.tpot_s, "finish_reason": final.finish_reason,
        }))
    else:
        sys.stdout.write("\n")
        n = len(final.token_ids)
        tps = 1.0 / final.tpot_s if final.tpot_s else float("nan")
        print(f"[{len(final.prompt_token_ids)} prompt tokens, {n} generated, finish={final.finish_reason}, "
              f"ttft {final.ttft_s:.3f}s, {tps:.1f} tok/s decode]", file=sys.stderr)
    return 0


def cmd_pack(a: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from hybrid.config import ModelConfig
    from hybrid.expert_pack import default_pack_dir, expert_bytes_to_read, verify_pack, write_pack
    from hybrid.models.experts import default_expert_format

    config = ModelConfig.from_dir(a.model_dir)
    fmt = a.experts or default_expert_format(config)
    out = Path(a.out) if a.out else default_pack_dir(a.model_dir, fmt)
    columns = (TextColumn("packing {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=a.quiet) as bar:
        task = bar.add_task(f"{config.model_dir.name} experts as {fmt}", total=expert_bytes_to_read(config))
        wrote = write_pack(a.model_dir, out, fmt, progress=lambda n: bar.advance(task, n))
    if a.verify:
        verify_pack(out)
    print(f"{out}: {'packed' if wrote else 'already up to date'}{' and verified' if a.verify else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridd", description="Local inference for large MoE models.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and exit")
    _add_engine_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object with ids, text and timings")
    g.set_defaults(func=cmd_generate)
    pk = sub.add_parser("pack", help="pack a checkpoint's routed experts into one mappable file")
    pk.add_argument("model_dir")
    pk.add_argument("--experts", choices=["bf16", "fp8", "int8", "int4"],
                    help="expert format (default: the checkpoint's, fp8 stays fp8)")
    pk.add_argument("--out", help="pack directory (default: $HYBRIDD_HOME/packs/NAME-HASH-FORMAT)")
    pk.add_argument("--verify", action="store_true", help="re-read the pack and check every checksum")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(func=cmd_pack)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except USER_ERRORS as e:
        print(f"hybridd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
