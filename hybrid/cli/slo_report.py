"""`hybridd slo-report`: drives an OpenAI-compatible endpoint with streaming requests at several concurrency
levels and reports TTFT, TPOT, inter-token and end-to-end latency percentiles against SLOs, plus goodput.

A level passes an SLO when its p90 meets it; goodput is the share of requests that met both SLOs.
Prompts are random token ids (exact lengths) when the server's /status gives its vocabulary, else words.

When the daemon's model directory is on this machine, the planner (hybrid/planner/) first predicts from short probes
what it should measure: per level the median of each request's predicted TTFT (alone, at its prompt length, as
the engine would run it) and the TPOT at that concurrency and the level's mean context, printed beside the
measured medians. Queueing behind other requests is not in the prediction.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from hybrid.cli.sse_client import StreamError, stream_chunks

# (prompt tokens low, high, max output tokens) per kind of request.
REQUEST_KINDS = {"chat": (64, 512, 128), "long-prefill": (4096, 16384, 32)}
WORKLOAD_MIX = {"chat": {"chat": 1.0}, "long-prefill": {"long-prefill": 1.0},
                "mixed": {"chat": 0.75, "long-prefill": 0.25}}
PERCENTILES = (50, 90, 99)
WORDS = ("time", "river", "model", "light", "north", "stone", "paper", "green", "quiet", "window", "number")


@dataclass
class SloConfig:
    url: str = "http://127.0.0.1:8000"
    workload: str = "chat"
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    requests: int = 16
    ttft_slo_s: float = 30.0
    tpot_slo_s: float = 0.05
    max_tokens: int | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    predict: bool = True

    def __post_init__(self) -> None:
        if self.workload not in WORKLOAD_MIX:
            raise ValueError(f"workload must be one of {sorted(WORKLOAD_MIX)}, got {self.workload!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be >= 1")
        if self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("SLOs must be positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.url = self.url.rstrip("/")


@dataclass
class RequestResult:
    kind: str
    prompt_tokens: int
    completion_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    def meets(self, ttft_slo: float, tpot_slo: float) -> bool:
        return (self.error is None and self.ttft_s is not None and self.ttft_s <= ttft_slo
                and (self.tpot_s is None or self.tpot_s <= tpot_slo))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values)
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES} | {"mean": float(arr.mean())}


class SloReport:
    def __init__(self, config: SloConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.model = ""
        self.max_model_len = 0
        self.vocab_size: int | None = None
        self.info: dict = {}
        self.plan = None

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def discover(self, client: httpx.AsyncClient) -> None:
        r = await client.get(f"{self.config.url}/v1/models", headers=self._headers())
        r.raise_for_status()
        card = r.json()["data"][0]
        self.model = card["id"]
        self.max_model_len = card.get("max_model_len") or 4096
        if self.config.max_tokens is not None and self.config.max_tokens > self.max_model_len // 2:
            raise ValueError(f"--max-tokens {self.config.max_tokens} leaves no room for the workload's prompts: the "
                             f"daemon's context is {self.max_model_len} tokens, so at most {self.max_model_len // 2}")
        try:
            status = await client.get(f"{self.config.url}/status", headers=self._headers())
            self.info = status.json()["info"]
            self.vocab_size = self.info["vocab_size"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            self.vocab_size = None

    def predict(self) -> str | None:
        """Runs the planner for the daemon's model and devices; returns why not when it cannot."""
        from hybrid.planner.plan import measure

        model_dir = self.info.get("model_dir")
        if not model_dir or not Path(model_dir, "config.json").is_file():
            return "no prediction: the daemon's model directory is not on this machine"
        devices = self.info.get("devices") or ["cpu"]
        gpus = self.info.get("gpus")
        attn = devices[0] if gpus else None
        self.plan = measure(model_dir, gpus, attn, self.info.get("expert_format", "auto"),
                            self.info.get("max_num_batched_tokens", 512), self.info.get("slp_max_tokens"),
                            self.info.get("dense_format", "auto"))
        return None

    def _summary(self) -> dict:
        from hybrid.planner.plan import summary

        return summary(self.plan)

    def predicted(self, results: list[RequestResult], concurrency: int) -> dict | None:
        if self.plan is None:
            return None
        ok = [r for r in results if r.error is None]
        if not ok:
            return None
        ttft = float(np.median([self.plan.ttft(r.prompt_tokens)["picked"] for r in ok]))
        context = int(np.mean([r.prompt_tokens + r.completion_tokens / 2 for r in ok]))
        running = min(concurrency, self.info.get("max_num_seqs", concurrency))
        return {"ttft_s_p50": ttft, "tpot_s": self.plan.tpot(running, context), "context": context}

    def make_request(self) -> tuple[str, dict]:
        mix = WORKLOAD_MIX[self.config.workload]
        kind = self.rng.choices(list(mix), weights=list(mix.values()))[0]
        low, high, out = REQUEST_KINDS[kind]
        out = min(self.config.max_tokens or out, self.max_model_len // 2)
        room = self.max_model_len - out
        n = min(self.rng.randint(low, high), room)
        if self.vocab_size:
            prompt = [self.rng.randrange(min(100, self.vocab_size // 2), self.vocab_size) for _ in range(n)]
        else:
            prompt = " ".join(self.rng.choice(WORDS) for _ in range(n))
        return kind, {"model": self.model, "prompt": prompt, "max_tokens": out, "temperature": 0.0,
                      "ignore_eos": True, "stream_options": {"include_usage": True}}

    async def one(self, client: httpx.AsyncClient, kind: str, body: dict) -> RequestResult:
        prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        result = RequestResult(kind, prompt_len)
        start = last = time.perf_counter()
        try:
            async for chunk in stream_chunks(client, f"{self.config.url}/v1/completions", body, self.config.api_key):
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        except (StreamError, httpx.HTTPError) as e:
            result.error = str(e) or type(e).__name__
            return result
        result.e2e_s = time.perf_counter() - start
        if result.ttft_s is not None and result.completion_tokens > 1:
            result.tpot_s = (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)
        return result

    async def level(self, client: httpx.AsyncClient, concurrency: int) -> dict:
        work = [self.make_request() for _ in range(self.config.requests)]
        gate = asyncio.Semaphore(concurrency)

        async def bounded(kind: str, body: dict) -> RequestResult:
            async with gate:
                return await self.one(client, kind, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(k, b) for k, b in work))
        wall = time.perf_counter() - start
        ok = [r for r in results if r.error is None]
        c = self.config
        summary = {
            "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "wall_s": wall, "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall,
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_s": percentiles([x for r in ok for x in r.itl_s]),
            "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
            "goodput": sum(r.meets(c.ttft_slo_s, c.tpot_slo_s) for r in results) / len(results),
            "predicted": self.predicted(results, concurrency),
            "results": [asdict(r) for r in results],
        }
        ttft90, tpot90 = summary["ttft_s"]["p90"], summary["tpot_s"]["p90"]
        summary["ttft_pass"] = ttft90 is not None and ttft90 <= c.ttft_slo_s
        summary["tpot_pass"] = bool(ok) and (tpot90 is None or tpot90 <= c.tpot_slo_s)
        return summary

    async def run(self, on_level=None, on_note=None) -> dict:
        async with httpx.AsyncClient(timeout=self.config.timeout_s) as client:
            await self.discover(client)
            if self.config.predict:
                why_not = self.predict()
                if why_not and on_note:
                    on_note(why_not)
            levels = []
            for c in self.config.concurrency:
                levels.append(await self.level(client, c))
                if on_level:
                    on_level(levels[-1])
        return {"config": asdict(self.config) | {"api_key": bool(self.config.api_key)},
                "server": {"model": self.model, "max_model_len": self.max_model_len},
                "slo": {"ttft_s": self.config.ttft_slo_s, "tpot_s": self.config.tpot_slo_s, "pass_rule": "p90"},
                "prediction": None if self.plan is None else self._summary(),
                "levels": levels}


def render_table(report: dict):
    from rich.table import Table

    slo = report["slo"]
    t = Table(title=f"SLO report: {report['server']['model']} · workload {report['config']['workload']} · "
                    f"TTFT <= {slo['ttft_s']:g}s, TPOT <= {slo['tpot_s'] * 1000:g}ms (pass = p90 within SLO)")
    predicted = any(lv.get("predicted") for lv in report["levels"])
    for col in ("conc", "reqs", "err", "TTFT p50/p90/p99 s", "TTFT", "TPOT p50/p90/p99 ms", "TPOT",
                "ITL p50/p99 ms", "E2E p50/p90/p99 s", "out tok/s", "goodput"):
        t.add_column(col, justify="right")
    if predicted:
        t.add_column("predicted TTFT p50 s / TPOT ms", justify="right")

    def trio(p: dict, scale: float = 1.0, keys=("p50", "p90", "p99")) -> str:
        return " / ".join("-" if p[k] is None else f"{p[k] * scale:.3g}" for k in keys)

    def verdict(ok: bool) -> str:
        return "[green]pass[/]" if ok else "[red]FAIL[/]"

    for lv in report["levels"]:
        pred = lv.get("predicted")
        extra = [] if not predicted else ["-" if not pred else
                                          f"{pred['ttft_s_p50']:.3g} / {pred['tpot_s'] * 1000:.3g}"]
        t.add_row(str(lv["concurrency"]), str(lv["requests"]), str(lv["errors"]), trio(lv["ttft_s"]),
                  verdict(lv["ttft_pass"]), trio(lv["tpot_s"], 1000), verdict(lv["tpot_pass"]),
                  trio(lv["itl_s"], 1000, ("p50", "p99")), trio(lv["e2e_s"]), f"{lv['output_tokens_per_s']:.1f}",
                  f"{lv['goodput']:.0%}", *extra)
    return t


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1))


def write_plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, slo, scale, label in ((axes[0], "ttft_s", report["slo"]["ttft_s"], 1.0, "TTFT (s)"),
                                       (axes[1], "tpot_s", report["slo"]["tpot_s"], 1000.0, "TPOT (ms)")):
        for p, style in zip(("p50", "p90", "p99"), ("o-", "s--", "^:")):
            ys = [np.nan if lv[key][p] is None else lv[key][p] * scale for lv in levels]
            ax.plot(xs, ys, style, label=p)
        ax.axhline(slo * scale, color="red", linewidth=1, label="SLO")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend()
    ax = axes[2]
    ax.bar([str(x) for x in xs], [lv["goodput"] * 100 for lv in levels], color="tab:green", label="goodput %")
    ax.set_ylim(0, 105)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("goodput (%)")
    twin = ax.twinx()
    twin.plot([str(x) for x in xs], [lv["output_tokens_per_s"] for lv in levels], "ko-", label="output tok/s")
    twin.set_ylabel("output tokens/s")
    fig.suptitle(f"{report['server']['model']} · {report['config']['workload']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
