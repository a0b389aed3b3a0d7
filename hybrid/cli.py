"""The `hybridd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import httpx

from hybrid.config import ConfigError
from hybrid.daemon import DaemonError
from hybrid.expert_client import ExpertServerError
from hybrid.expert_pack import PackError
from hybrid.loader import CheckpointError
from hybrid.sampling_params import SamplingParams
from hybrid.sse_client import StreamError
from hybrid.tokenizer import TokenizerError

USER_ERRORS = (ConfigError, CheckpointError, PackError, ExpertServerError, TokenizerError, ValueError,
               FileNotFoundError, DaemonError, StreamError)
DEFAULT_URL = "http://127.0.0.1:8000"


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
    p.add_argument("--attn-device", help="with --gpus: the device that plays GPU 0's role (cpu: the hybrid path "
                   "on the CPU, Triton attention under TRITON_INTERPRET=1)")
    p.add_argument("--no-overlap", action="store_true", help="with --gpus: no dual-batch attention/MoE overlap")
    p.add_argument("--enforce-eager", action="store_true", help="with --gpus: run decode eagerly instead of "
                   "replaying captured CUDA graphs")
    p.add_argument("--gpu-experts", type=int, default=0, help="with --gpus: keep the N most used experts of each "
                   "layer on the GPU (from --expert-profile, else from routing counts collected while serving)")
    p.add_argument("--expert-profile", help="routing-frequency profile JSON {layer: [count per expert]}")


def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants comma-separated device indices, got {text!r}") from None
    if not gpus:
        raise argparse.ArgumentTypeError("--gpus needs at least one device index")
    return gpus


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, num_kv_blocks=a.num_kv_blocks,
                kv_cache_bytes=int(a.kv_cache_gb * 2**30), backend=a.backend, expert_format=a.expert_format,
                dense_format=a.dense_format, num_threads=a.threads, expert_pack=a.expert_pack, experts=a.experts,
                expert_server=a.expert_server, gpus=getattr(a, "gpus", None), attn_device=a.attn_device,
                overlap=not a.no_overlap, enforce_eager=a.enforce_eager, gpu_experts=a.gpu_experts,
                expert_profile=a.expert_profile)


def _explain_gpus(gpus: list[int] | None) -> None:
    if gpus and len(gpus) > 1:
        print(f"hybridd: GPU {gpus[0]} runs attention, the KV cache and the dense layers; GPU(s) "
              f"{','.join(map(str, gpus[1:]))} are reserved for streamed prefill (SLP), which is not built yet, "
              "and stay idle for now", file=sys.stderr)


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
    _explain_gpus(a.gpus)
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


def _wait_ready(config, proc, timeout_s: float) -> None:
    """Shows packing/loading progress until /health answers ok; stops the daemon if it cannot start."""
    import time

    import httpx
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from hybrid.daemon import stop_daemon

    def give_up(reason: str) -> DaemonError:
        if proc.poll() is None:
            try:
                stop_daemon(config.paths)
            except DaemonError:
                proc.kill()
        return DaemonError(f"{reason} (logs in {config.paths.log_dir})")

    deadline = time.monotonic() + timeout_s
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(f"starting {config.model_name}", total=None)
        while True:
            if proc.poll() is not None:
                raise give_up(f"the daemon exited with code {proc.returncode} while starting")
            try:
                r = httpx.get(f"{config.url}/health", timeout=2.0)
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                return
            if r is not None and r.headers.get("content-type", "").startswith("application/json"):
                body = r.json()
                if body.get("status") == "down":
                    raise give_up(f"the engine could not start: {body.get('reason')}")
                prog = body.get("progress") or {}
                bar.update(task, description=prog.get("phase", body.get("status", "starting")),
                           completed=prog.get("done", 0), total=prog.get("total"))
            if time.monotonic() > deadline:
                raise give_up(f"not healthy after {timeout_s:.0f}s")
            time.sleep(0.25)


def cmd_start(a: argparse.Namespace) -> int:
    from hybrid.config import ModelConfig
    from hybrid.daemon import Supervisor, check_port_free, launch, running_daemon
    from hybrid.daemon_config import DaemonConfig
    from hybrid.llm import DEFAULT_MODEL_DIR

    model = str(Path(a.model).resolve()) if a.model else str(DEFAULT_MODEL_DIR)
    ModelConfig.from_dir(model)
    config = DaemonConfig(model=model, host=a.host, port=a.port, api_key=a.api_key,
                          served_model_name=a.served_model_name, max_queue=a.max_queue,
                          engine={k: v for k, v in _engine_kwargs(a).items() if v is not None})
    _explain_gpus(a.gpus)
    running = running_daemon(config.paths)
    if running is not None:
        raise DaemonError(f"hybridd is already running (pid {running['pid']}) at {running['url']}; "
                          "`hybridd stop` stops it")
    check_port_free(a.host, a.port)
    if a.foreground:
        print(f"hybridd: serving {config.model_name} at {config.url} (Ctrl-C stops)", file=sys.stderr)
        return Supervisor(config).run()
    _wait_ready(config, launch(config), a.timeout)
    print(f"hybridd is serving {config.model_name} at {config.url}\n"
          f"  chat page: {config.url}/   OpenAI API: {config.url}/v1   stop: hybridd stop")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    from hybrid.daemon import stop_daemon
    from hybrid.daemon_config import DaemonPaths, hybridd_home

    record = stop_daemon(DaemonPaths(hybridd_home()))
    print(f"hybridd stopped (pid {record['pid']}, {record['url']})")
    return 0


def _daemon_url(a: argparse.Namespace) -> str:
    from hybrid.daemon import running_daemon
    from hybrid.daemon_config import DaemonPaths, hybridd_home

    if a.url:
        return a.url
    record = running_daemon(DaemonPaths(hybridd_home()))
    return record["url"] if record else DEFAULT_URL


def cmd_status(a: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.table import Table

    url = _daemon_url(a)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        r = httpx.get(f"{url}/status", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        print(f"hybridd is not running at {url}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        raise DaemonError(f"{url}/status answered HTTP {r.status_code}: {r.text}")
    s = r.json()
    info, stats = s["info"], s["stats"]
    t = Table(title=f"hybridd at {url}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
    rows = [
        ("model", f"{s['model']} ({info.get('architecture', '?')}, context {info.get('max_model_len', '?')})"),
        ("state", s["status"] + (f": {s['reason']}" if s["reason"] else "")),
        ("mode", info.get("mode", "?")), ("devices", ", ".join(info.get("devices", []))),
        ("kernel path", info.get("kernel_path", "?")),
        ("experts", f"{info.get('experts', '?')}" + (f" (pid {info['expert_pid']})" if info.get("expert_pid") else "")),
        ("KV cache", f"{used}/{total} blocks ({used / total:.0%})" if total else "?"),
        ("requests", f"{stats.get('running', 0)} running, {stats.get('waiting', 0)} waiting, "
                     f"{s['pending']}/{s['max_pending']} admitted"),
        ("recent tokens/s", f"{stats.get('tokens_per_s', 0.0):.1f}"),
        ("engine", f"pid {s['engine_pid']}, {s['restarts']} restart(s)"),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    Console().print(t)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import asyncio

    from hybrid.chat_repl import ChatRepl

    repl = ChatRepl(_daemon_url(a), a.api_key, a.system, a.max_tokens, a.temperature)
    return asyncio.run(repl.run())


def cmd_doctor(a: argparse.Namespace) -> int:
    from rich.console import Console

    from hybrid.doctor import diagnose, render
    from hybrid.llm import DEFAULT_MODEL_DIR

    Console().print(render(diagnose(Path(a.model) if a.model else DEFAULT_MODEL_DIR, int(a.kv_cache_gb * 2**30))))
    return 0


def cmd_slo_report(a: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from hybrid.slo_report import SloConfig, SloReport, render_table, write_json, write_plot

    config = SloConfig(url=_daemon_url(a), workload=a.workload, concurrency=a.concurrency, requests=a.requests,
                       ttft_slo_s=a.ttft_slo, tpot_slo_s=a.tpot_slo, max_tokens=a.max_tokens, api_key=a.api_key,
                       seed=a.seed)
    console = Console(stderr=True)
    console.print(f"driving {config.url} with the {config.workload} workload, {config.requests} requests per level")
    report = asyncio.run(SloReport(config).run(
        lambda lv: console.print(f"  concurrency {lv['concurrency']}: {lv['requests'] - lv['errors']} ok, "
                                 f"goodput {lv['goodput']:.0%}")))
    Console(width=None if sys.stdout.isatty() else 200).print(render_table(report))
    if a.json:
        write_json(report, a.json)
        console.print(f"wrote {a.json}")
    if a.plot:
        write_plot(report, a.plot)
        console.print(f"wrote {a.plot}")
    return 0


def _levels(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency wants comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridd", description="Local inference for large MoE models.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and exit")
    _add_engine_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, comma-separated")
    g.add_argument("--gpus", type=_parse_gpus, help="hybrid path: attention, KV and dense layers on this CUDA "
                   "device, routed experts in the expert process (with --attn-device cpu: the CPU plays the GPU)")
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
    st = sub.add_parser("start", help="start the daemon (OpenAI API, web chat page, /metrics) in the background")
    _add_engine_args(st)
    st.set_defaults(experts="process")
    dev = st.add_mutually_exclusive_group()
    dev.add_argument("--gpus", type=_parse_gpus, help="CUDA devices: the first runs attention, KV cache and "
                     "dense layers; routed experts stay on the CPU (e.g. 0 or 0,1)")
    dev.add_argument("--cpu-only", action="store_true", help="run everything on the CPU (the default without CUDA)")
    st.add_argument("--host", default="127.0.0.1")
    st.add_argument("--port", type=int, default=8000)
    st.add_argument("--api-key", default=os.environ.get("HYBRIDD_API_KEY"),
                    help="require `Authorization: Bearer KEY` on every route but /health (env HYBRIDD_API_KEY)")
    st.add_argument("--served-model-name", help="model id in the API (default: the model directory's name)")
    st.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the running batch; "
                    "past it the API answers 503 with Retry-After")
    st.add_argument("--foreground", action="store_true", help="run in this terminal instead of the background")
    st.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for packing and loading")
    st.set_defaults(func=cmd_start)
    sp = sub.add_parser("stop", help="stop the daemon (in-flight requests finish or are aborted)")
    sp.set_defaults(func=cmd_stop)
    client_args = argparse.ArgumentParser(add_help=False)
    client_args.add_argument("--url", help="daemon URL (default: the running daemon's, else " + DEFAULT_URL + ")")
    client_args.add_argument("--api-key", default=os.environ.get("HYBRIDD_API_KEY"))
    ss = sub.add_parser("status", parents=[client_args], help="model, devices, kernel path, KV usage, requests")
    ss.set_defaults(func=cmd_status)
    ch = sub.add_parser("chat", parents=[client_args], help="chat with the daemon in this terminal")
    ch.add_argument("--system", help="system prompt")
    ch.add_argument("--max-tokens", type=int, default=512)
    ch.add_argument("--temperature", type=float, default=0.7)
    ch.set_defaults(func=cmd_chat)
    dr = sub.add_parser("doctor", help="CPU features, kernel path, GPUs, memory, whether the model fits")
    dr.add_argument("--model", help="model directory to check (default: the embedded tiny model)")
    dr.add_argument("--kv-cache-gb", type=float, default=1.0)
    dr.set_defaults(func=cmd_doctor)
    so = sub.add_parser("slo-report", parents=[client_args], help="measure TTFT/TPOT percentiles against SLOs")
    so.add_argument("--workload", default="chat", choices=["chat", "long-prefill", "mixed"])
    so.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8], help="levels, comma-separated")
    so.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    so.add_argument("--ttft-slo", type=float, default=30.0, help="seconds (default 30)")
    so.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token (default 0.05 = 20 tok/s)")
    so.add_argument("--max-tokens", type=int, help="output tokens per request (default: the workload's)")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--json", help="write the report as JSON here")
    so.add_argument("--plot", help="write a PNG chart here")
    so.set_defaults(func=cmd_slo_report)
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
    except httpx.HTTPError as e:
        where = f" {e.request.url}" if isinstance(e, httpx.RequestError) else ""
        print(f"hybridd: error: cannot reach the daemon{where}: {e} (is it running? `hybridd status`)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
