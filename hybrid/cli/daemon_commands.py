"""The commands that run or talk to the daemon: start, stop, status, chat and slo-report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybrid.cli.engine_args import add_engine_args, engine_kwargs, explain_gpus, follow_if_not_rank0, parse_gpus
from hybrid.managers.supervisor import DaemonError

CRASH_LOOP_EXITS = 2  # exits of one process before a start gives up (the first may be a restartable accident)

DEFAULT_URL = "http://127.0.0.1:8000"


def register(sub) -> None:
    st = sub.add_parser("start", help="start the daemon (OpenAI API, web chat page, /metrics) in the background")
    add_engine_args(st)
    dev = st.add_mutually_exclusive_group()
    dev.add_argument("--gpus", type=parse_gpus, help="CUDA devices: the first runs attention, KV cache and "
                     "dense layers; routed experts stay on the CPU (e.g. 0 or 0,1)")
    dev.add_argument("--cpu-only", action="store_true", help="run everything on the CPU (the default: nothing runs on "
                     "a GPU without --gpus)")
    st.add_argument("--disagg", action=argparse.BooleanOptionalAction,
                    help="run prefill and decode in two engine processes on separate cores, so that long prompts "
                    "never stall running chats (default: on with --gpus where the GPU holds both engines, else off)")
    st.add_argument("--prefill-cores", type=int, help="with --disagg: cores of the prefill engine (default: half)")
    st.add_argument("--host", default="127.0.0.1")
    st.add_argument("--port", type=int, default=8000)
    st.add_argument("--api-key", default=os.environ.get("HYBRIDD_API_KEY"),
                    help="require `Authorization: Bearer KEY` on every route but /health (env HYBRIDD_API_KEY)")
    st.add_argument("--served-model-name", help="model id in the API (default: the model directory's name)")
    st.add_argument("--chat-template", help="a Jinja chat template (a file, or the text itself) replacing the "
                    "model's: for base models, or a template that renders tools or roles badly")
    st.add_argument("--max-body-mb", type=float, default=4.0,
                    help="largest request body accepted, in MiB (larger ones get 413)")
    st.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the running batch; "
                    "past it the API answers 503 with Retry-After")
    st.add_argument("--foreground", action="store_true", help="run in this terminal instead of the background")
    st.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds from the launch to wait for packing and loading")
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
    so.add_argument("--no-predict", action="store_true", help="skip the planner's prediction (its probes take a "
                    "few seconds before the load starts)")
    so.set_defaults(func=cmd_slo_report)


def log_sizes(log_dir: Path) -> dict[Path, int]:
    return {path: path.stat().st_size for path in log_dir.glob("*.log")}


def last_log_lines(log_dir: Path, before: dict[Path, int]) -> str:
    """The last line each log gained since `before` (logs are appended to, run after run): where every process
    of a daemon that did not start had got to."""
    lines = []
    for path in sorted(log_dir.glob("*.log")):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(max(before.get(path, 0), path.stat().st_size - 4096))
            tail = f.read().decode(errors="replace").strip().splitlines()
            if tail:
                lines.append(f"\n  {path.stem}: {tail[-1][:300]}")
    return "".join(lines)


def crash_loop(paths, supervisor_pid: int, supervisor_created: float) -> str | None:
    """What is wrong if a process of the starting daemon keeps exiting (the supervisor restarts it, and an api
    that cannot start would leave /health silent until the timeout); None while none does. Only this
    supervisor's record counts (its pid and start time: an earlier supervisor's record, left until the new one
    removes it, may carry the same pid); it holds the exits within its restart window."""
    try:
        record = json.loads(paths.exits_file.read_text())
        if record["supervisor"] != supervisor_pid or abs(record["create_time"] - supervisor_created) >= 0.01:
            return None
        exits = record["exits"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for role, codes in exits.items():
        if len(codes) >= CRASH_LOOP_EXITS:
            return f"the {role} process exited {len(codes)} times while starting (exit codes {codes})"
    return None


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on TCP `port`: the server answering there is
    this daemon's, not one that took the port after start checked it was free."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for p in tree:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return True
    return False


def _wait_ready(config, proc, deadline: float, timeout_s: float, logs_before: dict[Path, int]) -> None:
    """Shows packing/loading progress until /health answers ok; stops the daemon if it is not healthy by
    `deadline` (time.monotonic(), timeout_s after the launch)."""
    import httpx
    import psutil
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from hybrid.managers.supervisor import ALREADY_RUNNING_EXIT

    created = psutil.Process(proc.pid).create_time()  # readable until reaped, even once it has exited

    def give_up(reason: str) -> DaemonError:
        where = last_log_lines(config.paths.log_dir, logs_before)  # before stopping, which logs its own lines
        abandon(proc)
        return DaemonError(f"{reason} (logs in {config.paths.log_dir}); where each process was:{where}")

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(f"starting {config.model_name}", total=None)
        while True:
            if proc.poll() == ALREADY_RUNNING_EXIT:
                raise DaemonError(f"hybridd is already running with HYBRIDD_HOME={config.paths.home}; "
                                  "`hybridd stop` stops it")
            looping = crash_loop(config.paths, proc.pid, created)  # first: one that gave up has exited too
            if looping is not None:
                raise give_up(looping)
            if proc.poll() is not None:
                raise give_up(f"the daemon exited with code {proc.returncode} while starting")
            asked_in_time = time.monotonic() <= deadline  # a reply to a later question is too late, however good
            try:
                r = httpx.get(f"{config.url}/health", timeout=2.0)
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200 and asked_in_time:
                if not listens_on(proc.pid, config.port):
                    raise give_up(f"another server took port {config.port} while this daemon started, and answers "
                                  f"at {config.url}; choose another --port")
                return
            if r is not None and r.headers.get("content-type", "").startswith("application/json"):
                body = r.json()
                if body.get("status") == "down":
                    raise give_up(f"the engine could not start: {body.get('reason')}")
                prog = body.get("progress") or {}
                bar.update(task, description=prog.get("phase", body.get("status", "starting")),
                           completed=prog.get("done", 0), total=prog.get("total"))
            if time.monotonic() > deadline:
                raise give_up(f"not healthy after {timeout_s:g}s")
            time.sleep(0.25)


def default_disagg(a: argparse.Namespace, model: str) -> bool:
    """--disagg's default, said on stderr where GPUs are in play (CPU only it is off, as it always was)."""
    if not a.gpus:
        return False
    import torch

    from hybrid.config import EngineConfig
    from hybrid.planner.costs import ModelCosts
    from hybrid.planner.disagg_choice import choose_disagg

    device = torch.device(a.attn_device or f"cuda:{a.gpus[0]}")
    total = None
    if device.type == "cuda":
        total = gpu_memory(device.index or 0)
        if total is None:  # no such GPU: the engine's checks of --gpus say so
            return False
    engine = EngineConfig(model=model, dtype=a.dtype)
    costs = ModelCosts.from_dir(model, a.expert_format)
    item_bytes = engine.torch_dtype(costs.config).itemsize
    kv_bytes = (a.num_kv_blocks * engine.block_size * costs.kv_bytes_per_token(item_bytes) if a.num_kv_blocks
                else int(a.kv_cache_gb * 2**30))  # the pool's cap: --num-kv-blocks sets it exactly
    choice = choose_disagg(costs, total, item_bytes, kv_bytes)
    print(f"hybridd: {choice.why}", file=sys.stderr)
    return choice.on


def gpu_memory(index: int) -> int | None:
    """The GPU's memory in bytes, asked in a child process: CUDA initialized here would keep a context (hundreds of
    MB of that GPU) in the supervisor for the daemon's life. None where CUDA cannot see the device."""
    probe = ("import sys, torch; i = int(sys.argv[1]); "
             "print(torch.cuda.get_device_properties(i).total_memory if i < torch.cuda.device_count() else '')")
    r = subprocess.run([sys.executable, "-c", probe, str(index)], capture_output=True, text=True,
                       timeout=120)
    out = r.stdout.strip()
    return int(out) if r.returncode == 0 and out.isdigit() else None


def check_model(model: str, chat_template: str | None) -> None:
    """What the engines would refuse in the model directory: its config, read by transformers' classes, and its
    tokenizer (which may be missing unless a chat template is given to render with it)."""
    from hybrid.config import ModelConfig
    from hybrid.tokenizer import MissingTokenizer, Tokenizer

    ModelConfig.from_dir(model)
    try:
        Tokenizer(model)
    except MissingTokenizer:
        if chat_template is not None:
            raise


def abandon(proc: subprocess.Popen) -> None:
    """Stops the supervisor this command launched: itself, not whichever daemon the pid file names, which may be
    another start's that won the home's lock."""
    from hybrid.managers.supervisor import API_STOP_S, ENGINE_STOP_S

    proc.terminate()
    try:
        proc.wait(API_STOP_S + ENGINE_STOP_S + 5)  # past the supervisor's own limits, so it cleans up after itself
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (launch): the supervisor and what it started
        proc.wait()


def cmd_start(a: argparse.Namespace) -> int:
    from hybrid.config import ModelConfig
    from hybrid.config.home import PRIVATE_UMASK
    from hybrid.config.model_config import DEFAULT_MODEL_DIR, read_config
    from hybrid.managers.daemon_config import DaemonConfig
    from hybrid.managers.supervisor import Supervisor, check_port_free, core_split, launch, running_daemon
    from hybrid.tokenizer import load_chat_template

    model = str(Path(a.model).resolve()) if a.model else str(DEFAULT_MODEL_DIR)
    # The daemon's experts run in the expert process, except that tensor-parallel / pipeline ranks each compute
    # their own share in their process, and the torch reference computes them itself.
    a.experts = a.experts or ("inline" if a.tp * a.pp > 1 or (a.backend == "torch" and not a.gpus) else "process")
    if follow_if_not_rank0(a, model):
        return 0
    from hybrid.distributed.torchrun import under_torchrun

    a.foreground = a.foreground or under_torchrun()  # torchrun keeps the ranks' lifetimes together
    read_config(Path(model))  # a wrong directory or architecture is refused before anything starts
    chat_template = load_chat_template(a.chat_template) if a.chat_template else None
    config = DaemonConfig(model=model, host=a.host, port=a.port, api_key=a.api_key,
                          served_model_name=a.served_model_name, chat_template=chat_template,
                          max_queue=a.max_queue, max_body_mb=a.max_body_mb,
                          engine={k: v for k, v in engine_kwargs(a).items() if v is not None},
                          disagg=a.disagg if a.disagg is not None else default_disagg(a, model),
                          prefill_cores=a.prefill_cores)
    if config.disagg:  # the split of the cores the supervisor will make, checked here
        core_split(sorted(os.sched_getaffinity(0)), config.prefill_cores)
    if a.expert_pack:  # a pack the engines would refuse is refused here, before anything starts
        from hybrid.experts.pack import engine_pack

        engine_pack(ModelConfig.from_dir(model), a.expert_format, a.expert_pack)
    explain_gpus(a.gpus, a.slp_threshold)
    running = running_daemon(config.paths)
    if running is not None:
        raise DaemonError(f"hybridd is already running (pid {running['pid']}) at {running['url']}; "
                          "`hybridd stop` stops it")
    check_port_free(a.host, a.port)
    if a.foreground:
        check_model(model, chat_template)
        os.umask(PRIVATE_UMASK)
        print(f"hybridd: serving {config.model_name} at {config.url} (Ctrl-C stops)", file=sys.stderr)
        return Supervisor(config).run()
    config.paths.make()
    logs_before = log_sizes(config.paths.log_dir)
    proc = launch(config)
    deadline = time.monotonic() + a.timeout
    try:  # transformers' checks take seconds to import: made while the daemon's processes import too
        check_model(model, chat_template)
    except BaseException:
        abandon(proc)
        raise
    _wait_ready(config, proc, deadline, a.timeout, logs_before)
    print(f"hybridd is serving {config.model_name} at {config.url}\n"
          f"  chat page: {config.url}/   OpenAI API: {config.url}/v1   stop: hybridd stop")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    from hybrid.config.home import hybridd_home
    from hybrid.managers.daemon_config import DaemonPaths
    from hybrid.managers.supervisor import stop_daemon

    record = stop_daemon(DaemonPaths(hybridd_home()))
    print(f"hybridd stopped (pid {record['pid']}, {record['url']})")
    return 0


def _daemon_url(a: argparse.Namespace) -> str:
    from hybrid.config.home import hybridd_home
    from hybrid.managers.daemon_config import DaemonPaths
    from hybrid.managers.supervisor import running_daemon

    if a.url:
        return a.url.rstrip("/")
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
        ("mode", info.get("mode", "?") + _parallel_text(info.get("parallel"))),
        ("devices", ", ".join(info.get("devices", []))),
        ("kernel path", info.get("kernel_path", "?")),
        ("experts", f"{info.get('experts', '?')}" + (f" (pid {info['expert_pid']})" if info.get("expert_pid") else "")),
        ("KV cache", f"{used}/{total} blocks ({used / total:.0%})" if total else "?"),
        ("prefix cache", _prefix_cache_row(stats)),
        ("streamed prefill", _slp_row(stats.get("slp"))),
        ("requests", f"{stats.get('running', 0)} running, {stats.get('waiting', 0)} waiting, "
                     f"{s['pending']}/{s['max_pending']} admitted"),
        ("recent tokens/s", f"{stats.get('tokens_per_s', 0.0):.1f}"),
    ]
    for role, e in s.get("engines", {}).items():
        es = e.get("stats", {})
        load = (f", {es.get('running', 0)} running, {es.get('waiting', 0)} waiting, {es.get('handoffs', 0)} "
                f"handing off, KV {es.get('kv_blocks_used', 0)}/{es.get('kv_blocks_total', 0)} blocks") if es else ""
        rows.append((role, f"{e['status']}, pid {e['pid']}, {e['restarts']} restart(s){load}"))
    for k, v in rows:
        t.add_row(k, str(v))
    Console().print(t)
    return 0


def _parallel_text(parallel: dict | None) -> str:
    if not parallel:
        return ""
    reduce = f", all-reduce over {parallel['all_reduce']}" if parallel.get("all_reduce") else ""
    return f" (--tp {parallel['tp']} --pp {parallel['pp']}{reduce})"


def _slp_row(slp: dict | None) -> str:
    if slp is None:
        return "off"
    threshold = f"from {slp['threshold']} tokens" if slp["threshold"] is not None else "never (CPU experts are faster)"
    devices = slp.get("devices", 1)
    over = f" over {devices} devices (SmallEP)" if devices > 1 else ""
    return (f"{threshold}; {slp['passes']} passes, {slp['tokens']} tokens, {slp['streamed_bytes'] / 1e9:.2f} GB "
            f"streamed{over} at {slp['gb_per_s']:.2f} GB/s")


def _prefix_cache_row(stats: dict) -> str:
    if not stats.get("prefix_cache"):
        return "off"
    queried, hits = stats.get("prefix_queried_tokens", 0), stats.get("prefix_hit_tokens", 0)
    rate = f", {hits / queried:.0%} of {queried} prompt tokens reused" if queried else ""
    return f"{stats.get('kv_blocks_cached', 0)} blocks cached{rate}"


def cmd_chat(a: argparse.Namespace) -> int:
    import asyncio

    from hybrid.cli.chat_repl import ChatRepl

    repl = ChatRepl(_daemon_url(a), a.api_key, a.system, a.max_tokens, a.temperature)
    return asyncio.run(repl.run())


def cmd_slo_report(a: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from hybrid.cli.slo_report import SloConfig, SloReport, render_table, write_json, write_plot

    config = SloConfig(url=_daemon_url(a), workload=a.workload, concurrency=a.concurrency, requests=a.requests,
                       ttft_slo_s=a.ttft_slo, tpot_slo_s=a.tpot_slo, max_tokens=a.max_tokens, api_key=a.api_key,
                       seed=a.seed, predict=not a.no_predict)
    console = Console(stderr=True)
    console.print(f"driving {config.url} with the {config.workload} workload, {config.requests} requests per level")
    report = asyncio.run(SloReport(config).run(
        lambda lv: console.print(f"  concurrency {lv['concurrency']}: {lv['requests'] - lv['errors']} ok, "
                                 f"goodput {lv['goodput']:.0%}"), console.print))
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
