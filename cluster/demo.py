"""`kvmesh demo`: the mesh with the real model and a workload that shows each kind of reuse.

The demo starts an embedded mesh (`cluster.connect`), sends three phases of chat
requests through the front door, and prints one table per phase:

1. shared system prompts: three products' system prompts (300-350 tokens each), each
   followed by several users' questions, interleaved as they would arrive. The first
   request of each system prompt goes to the next worker in turn, as a load balancer
   spreads new traffic; every later one is routed by the mesh to the worker holding
   the longest prefix, so it computes only its question.
2. multi-turn conversations: each turn's prompt is the previous prompt, the model's
   reply and the user's next message. Every turn runs on another worker than the turn
   before, so the earlier turns' pages are copied from the worker that computed them
   (`remote_hit_tokens`; on one machine the copy comes out of that worker's shared
   memory).
3. two tenants: "acme" and then "globex" send byte-identical prompts (the first is
   phase one's first support prompt, so tenant "default" holds it too). Globex's first
   request runs on the very worker that holds acme's pages, and still computes every
   token: tenants never share pages. `cross_tenant_hit_tokens` counts, for every
   request, the hit tokens beyond the longest prefix its own tenant had computed
   before; it is 0.

A request counts as reusing when at least one page of its prompt came from a cache
(local or copied); "TTFT cold" is the median over the others, "TTFT with reuse" over
these. At the end every reusing request runs again on the same worker with
`reuse=False` (the whole prompt computed, nothing reused or published): the same
workload's time to first token without the cache. `speedup` is the median TTFT of those
requests without the cache over their median TTFT with it. `hit_rate` is the share of
the workload's prompt tokens served from a cache (local or copied), before that rerun.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster.config import KvmeshConfig, load_config
from cluster.demo_prompts import (
    CONVERSATIONS,
    QUESTIONS,
    SYSTEM_PROMPTS,
    TENANT_QUESTIONS,
    TENANT_SYSTEM,
    TENANTS,
)

MAX_NEW_TOKENS = 10  # a short reply: the demo is about the prompt, not the decode
PHASES = {
    "prompts": "shared system prompts",
    "turns": "multi-turn conversations",
    "tenants": "two tenants, identical prompts",
}
END_OF_TURN = "<|im_end|>\n"
_WORD = re.compile(r"\w+|[^\w\s]|\n")  # the tiny model's "tokens": words and punctuation


class Workload(NamedTuple):
    """How many requests each phase sends."""

    questions: int  # per system prompt (phase 1)
    turns: int  # per conversation (phase 2)
    tenant_questions: int  # per tenant (phase 3)

    def size(self, phase: str) -> int:
        """Requests the phase sends."""
        return {
            "prompts": len(SYSTEM_PROMPTS) * self.questions,
            "turns": len(CONVERSATIONS) * self.turns,
            "tenants": len(TENANTS) * self.tenant_questions,
        }[phase]

    @property
    def requests(self) -> int:
        return sum(self.size(phase) for phase in PHASES)


class Request(NamedTuple):
    phase: str  # a key of PHASES
    label: str  # what the progress line calls it: "support q2", "A turn 3", "globex q1"
    group: str  # the row of the phase's table it counts in
    tenant: str
    tokens: list[int]
    worker: str | None  # forced onto this worker; None: routed by the mesh


class Record(NamedTuple):
    """One request as it ran."""

    request: Request
    worker: str
    reply: list[int]
    local: int  # prompt tokens found in the worker's own cache
    remote: int  # prompt tokens copied from another worker
    computed: int
    ttft_s: float
    cross_tenant: int  # hit tokens beyond any prefix the request's own tenant computed
    # At least a page of the prompt came from a cache. Every prompt opens with the chat
    # template's few tokens, which any worker that served another prompt holds and
    # reuses (copy-on-write of a partly matching page); they do not make a request warm.
    reused: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.tokens)

    @property
    def hit_tokens(self) -> int:
        return self.local + self.remote


def workload(scale: float = 1.0) -> Workload:
    """The demo's request counts at `scale` (1.0: 15 + 6 + 8 requests).

    Raises:
        ValueError: scale not > 0.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    questions = min(len(q) for q in QUESTIONS.values())
    turns = min(len(messages) for _, messages in CONVERSATIONS)
    return Workload(
        _scaled(5, scale, 2, questions),
        _scaled(3, scale, 3, turns),
        _scaled(4, scale, 2, len(TENANT_QUESTIONS)),
    )


def _scaled(count: int, scale: float, low: int, high: int) -> int:
    # Phase 1 needs two questions per prompt to show a hit, phase 2 three turns to show
    # a turn that both reuses its own pages and copies its peer's.
    return max(low, min(high, round(count * scale)))


# ---------------------------------------------------------------------- text to tokens


class Encoder:
    """Text to token ids: the model's tokenizer, or, for a model without one (the tiny
    test model), a deterministic map of words and punctuation onto its vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_ids = frozenset() if eos is None else frozenset([eos])

    def __call__(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        # id 0 left out: a word never maps onto what a tokenizer would use as padding
        return [1 + zlib.crc32(w.encode()) % (self._vocab - 1) for w in _WORD.findall(text)]

    def reply(self, token_ids: Sequence[int]) -> list[int]:
        """The reply as the next turn quotes it: up to its end-of-turn token."""
        ids = list(token_ids)
        end = next((i for i, t in enumerate(ids) if t in self.end_ids), len(ids))
        return ids[:end]


def system_turn(text: str) -> str:
    return f"<|im_start|>system\n{text}{END_OF_TURN}"


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}{END_OF_TURN}<|im_start|>assistant\n"


def _vocab_size(model: str) -> int:
    if model == "tiny":
        from workers.serving.model_loader import tiny_llama

        return tiny_llama().config.vocab_size
    return 0  # a model with a tokenizer: its own ids


# ---------------------------------------------------------------------- sending


class Session:
    """Sends requests through the mesh, records them and shows each on the progress."""

    def __init__(self, mesh: Any, encode: Encoder):
        self.mesh = mesh
        self.encode = encode
        self.progress: Progress | None = None  # the running phase's
        self.page_tokens = mesh.config.cache.page_tokens
        self.records: list[Record] = []
        # Per tenant: every sequence whose KV it computed (prompt + reply but its last
        # token, which is sampled and never run).
        self._history: dict[str, list[list[int]]] = {}

    def send(self, request: Request) -> Record:
        """Run one request (routed, or on its forced worker) and record it."""
        result = self.mesh.generate(
            request.tokens, MAX_NEW_TOKENS, tenant=request.tenant, worker=request.worker
        )
        # Workers publish in the background a moment after each request; the next request
        # of the demo comes at once, so it waits for that to have happened.
        self.mesh.flush()
        s = result.stats
        hits = s["local_hit_tokens"] + s["remote_hit_tokens"]
        own = self._history.setdefault(request.tenant, [])
        reach = max((_common_prefix(request.tokens, seq) for seq in own), default=0)
        record = Record(
            request,
            s["worker"],
            list(result.token_ids),
            s["local_hit_tokens"],
            s["remote_hit_tokens"],
            s["computed_tokens"],
            s["ttft_s"],
            max(0, hits - reach),
            hits >= self.page_tokens,
        )
        own.append(request.tokens + record.reply[:-1])
        self.records.append(record)
        if self.progress is not None:
            self.progress.console.print(_progress_line(record), soft_wrap=True)
            self.progress.advance(self.progress.task_ids[0])
        return record


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _progress_line(r: Record) -> str:
    routed = "placed on" if r.request.worker else "routed to"
    return (
        f"  {r.request.label:<14} [{r.request.tenant}] {routed} {r.worker}: "
        f"{r.prompt_tokens} tokens, local {r.local}, copied {r.remote}, "
        f"computed {r.computed}; TTFT {1000 * r.ttft_s:.0f} ms"
    )


# ---------------------------------------------------------------------- the phases


def phase_prompts(session: Session, plan: Workload, workers: list[str]) -> None:
    """Phase 1: every system prompt's questions, interleaved; first arrivals spread."""
    systems = {name: session.encode(system_turn(text)) for name, text in SYSTEM_PROMPTS.items()}
    for q in range(plan.questions):
        for i, (name, system) in enumerate(systems.items()):
            question = QUESTIONS[name][q]
            first = workers[i % len(workers)] if q == 0 else None
            tokens = system + session.encode(user_turn(question))
            session.send(Request("prompts", f"{name} q{q + 1}", name, "default", tokens, first))


def phase_turns(session: Session, plan: Workload, workers: list[str]) -> None:
    """Phase 2: the conversations turn by turn, each turn on another worker than the
    last (the first turn routed)."""
    prompts = [
        session.encode(system_turn(SYSTEM_PROMPTS[system]) + user_turn(messages[0]))
        for system, messages in CONVERSATIONS
    ]
    last: list[str | None] = [None] * len(CONVERSATIONS)
    for turn in range(plan.turns):
        for c, (_, messages) in enumerate(CONVERSATIONS):
            name = f"{chr(ord('A') + c)} turn {turn + 1}"
            worker = None if last[c] is None else _other(workers, last[c])
            record = session.send(Request("turns", name, name, "default", prompts[c], worker))
            last[c] = record.worker
            if turn + 1 < plan.turns:
                follow = session.encode(END_OF_TURN + user_turn(messages[turn + 1]))
                prompts[c] = prompts[c] + session.encode.reply(record.reply) + follow


def phase_tenants(session: Session, plan: Workload, workers: list[str]) -> None:
    """Phase 3: each tenant sends the same prompts; the second tenant's first request
    runs where the first tenant's copy of that very prompt is cached."""
    system = session.encode(system_turn(SYSTEM_PROMPTS[TENANT_SYSTEM]))
    prompts = [system + session.encode(user_turn(q)) for q in TENANT_QUESTIONS]
    holder: str | None = None
    for t, tenant in enumerate(TENANTS):
        for q in range(plan.tenant_questions):
            worker = holder if t > 0 and q == 0 else None
            label = f"{tenant} q{q + 1}"
            record = session.send(Request("tenants", label, label, tenant, prompts[q], worker))
            holder = holder or record.worker


def _other(workers: list[str], worker: str) -> str:
    return workers[(workers.index(worker) + 1) % len(workers)]


PHASE_RUNS: dict[str, Callable[[Session, Workload, list[str]], None]] = {
    "prompts": phase_prompts,
    "turns": phase_turns,
    "tenants": phase_tenants,
}


def run_baseline(mesh: Any, records: Sequence[Record], progress: Progress) -> list[float]:
    """TTFT of each reusing request computed again without the cache, on its worker.

    Returns:
        One TTFT per `reused` record, in the order of `records`.
    """
    ttfts = []
    for r in records:
        if not r.reused:
            continue
        # One new token: the time to the first is all the comparison needs.
        result = mesh.generate(
            r.request.tokens, 1, tenant=r.request.tenant, worker=r.worker, reuse=False
        )
        ttfts.append(result.stats["ttft_s"])
        progress.console.print(
            f"  {r.request.label:<14} [{r.request.tenant}] on {r.worker} without the cache: "
            f"computed {result.stats['computed_tokens']}; TTFT "
            f"{1000 * ttfts[-1]:.0f} ms (with reuse {1000 * r.ttft_s:.0f} ms)",
            soft_wrap=True,
        )
        progress.advance(progress.task_ids[-1])
    return ttfts


# ---------------------------------------------------------------------- figures


def figures(records: Sequence[Record]) -> dict[str, Any]:
    """Token sources, hit rate and median TTFTs over `records`.

    Returns:
        {"requests", "prompt_tokens", "local_hit_tokens", "remote_hit_tokens",
        "computed_tokens", "hit_rate", "ttft_cold_s" (median over the requests that
        reused less than a page; None without any), "ttft_reuse_s" (median over the
        others; None)}.
    """
    prompt = sum(r.prompt_tokens for r in records)
    local = sum(r.local for r in records)
    remote = sum(r.remote for r in records)
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "local_hit_tokens": local,
        "remote_hit_tokens": remote,
        "computed_tokens": sum(r.computed for r in records),
        "hit_rate": round((local + remote) / prompt, 4) if prompt else 0.0,
        "ttft_cold_s": _median([r.ttft_s for r in records if not r.reused]),
        "ttft_reuse_s": _median([r.ttft_s for r in records if r.reused]),
    }


def comparison(records: Sequence[Record], baseline: Sequence[float]) -> dict[str, Any]:
    """With reuse against without the cache, over the reusing records.

    Args:
        records: the requests as they ran.
        baseline: their reusing records' TTFTs without the cache (`run_baseline`).
    Returns:
        {"requests", "ttft_reuse_s", "ttft_no_cache_s", "speedup"} (medians; None
        when no record reused anything).
    """
    reused = [r.ttft_s for r in records if r.reused]
    assert len(reused) == len(baseline), f"{len(reused)} reusing requests, {len(baseline)} reruns"
    with_cache, without = _median(reused), _median(list(baseline))
    speedup = round(without / with_cache, 2) if with_cache and without else None
    return {
        "requests": len(reused),
        "ttft_reuse_s": with_cache,
        "ttft_no_cache_s": without,
        "speedup": speedup,
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


# ---------------------------------------------------------------------- tables


def phase_table(phase: str, records: Sequence[Record], cluster_hit_rate: float) -> Table:
    """One phase: a row per group (system prompt, turn, tenant request) and a total."""
    table = Table(
        title=f"{phase}: {PHASES[phase]}",
        caption=f"cluster hit rate so far (all workers, mesh.stats): {100 * cluster_hit_rate:.1f}%",
        box=box.SIMPLE,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("")
    table.add_column("workers")
    for name in ("requests", "prompt", "local", "copied", "computed", "hit rate"):
        table.add_column(name, justify="right")
    table.add_column("TTFT cold", justify="right")
    table.add_column("TTFT with reuse", justify="right")
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.request.group, []).append(r)
    for name, rows in groups.items():
        table.add_row(name, ",".join(sorted({r.worker for r in rows})), *_cells(rows))
    table.add_section()
    table.add_row("all", ",".join(sorted({r.worker for r in records})), *_cells(records))
    return table


def _cells(records: Sequence[Record]) -> list[str]:
    f = figures(records)
    return [
        str(f["requests"]),
        str(f["prompt_tokens"]),
        str(f["local_hit_tokens"]),
        str(f["remote_hit_tokens"]),
        str(f["computed_tokens"]),
        f"{100 * f['hit_rate']:.1f}%",
        _seconds(f["ttft_cold_s"]),
        _seconds(f["ttft_reuse_s"]),
    ]


def comparison_table(records: Sequence[Record], baseline: Sequence[float]) -> Table:
    """TTFT with reuse against without the cache, per phase and over the workload."""
    table = Table(
        title="with the cache and without it",
        caption=(
            "each request that reused a page or more, run again on its worker, reuse=False;\n"
            "speedup = median TTFT without the cache / median TTFT with reuse"
        ),
        box=box.SIMPLE,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("")
    for name in ("reusing requests", "TTFT with reuse", "TTFT without cache", "speedup"):
        table.add_column(name, justify="right")
    rest = iter(baseline)
    for phase in PHASES:
        rows = [r for r in records if r.request.phase == phase]
        reruns = [next(rest) for r in rows if r.reused]
        table.add_row(phase, *_comparison_cells(comparison(rows, reruns)))
    table.add_section()
    table.add_row("all", *_comparison_cells(comparison(records, baseline)))
    return table


def _comparison_cells(c: dict[str, Any]) -> list[str]:
    speedup = "-" if c["speedup"] is None else f"{c['speedup']:.1f}x"
    return [
        str(c["requests"]),
        _seconds(c["ttft_reuse_s"]),
        _seconds(c["ttft_no_cache_s"]),
        speedup,
    ]


# ---------------------------------------------------------------------- the run


@contextmanager
def _progress(console: Console, description: str, total: int) -> Iterator[Progress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        progress.add_task(description, total=total)
        yield progress


def demo_console(file: TextIO) -> Console:
    """A console for the demo's lines and tables: the terminal's width, or 120 columns
    when writing to a file or a pipe (where rich would assume 80 and wrap the tables)."""
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console.width = 120
    return console


def run_demo(
    config: str | Path | KvmeshConfig | None = None,
    log: TextIO = sys.stderr,
    scale: float = 1.0,
    out: Console | None = None,
) -> dict[str, Any]:
    """Start a mesh, run the demo's workload and the comparison, and stop the mesh.

    Args:
        config: a YAML path or a KvmeshConfig (default configs/local.yaml).
        log: where start-up messages and the progress go.
        scale: multiplies the number of requests (see `workload`).
        out: where the URLs and the tables go (default: `log`).
    Returns:
        The figures (the JSON object of `kvmesh demo --json`): `figures()` over the whole
        workload plus "ttft_no_cache_s", "speedup", "cross_tenant_hit_tokens",
        "cluster_hit_rate", "phases", "workers", "model", "dashboard_url",
        "metrics_url", "seconds".
    Raises:
        ValueError: scale not > 0.
    """
    import cluster
    from cluster.mesh import DEFAULT_CONFIG

    start = time.perf_counter()
    plan = workload(scale)
    cfg = config if isinstance(config, KvmeshConfig) else load_config(config or DEFAULT_CONFIG)
    err = demo_console(log)
    out = out or err
    mesh = cluster.connect(config=cfg, log=log)
    try:
        _header(mesh, out, err)
        encode = Encoder(mesh.tokenizer, _vocab_size(mesh.config.model.name))
        workers = sorted(mesh.workers)
        session = Session(mesh, encode)
        phases: dict[str, Any] = {}
        for n, (phase, run) in enumerate(PHASE_RUNS.items(), 1):
            title = f"phase {n}/{len(PHASE_RUNS)}: {PHASES[phase]}"
            err.print(title)
            begin = len(session.records)
            with _progress(err, title, plan.size(phase)) as progress:
                session.progress = progress
                run(session, plan, workers)
            session.progress = None
            done = session.records[begin:]
            phases[phase] = figures(done)
            out.print(phase_table(phase, done, mesh.stats()["hit_rate"]))
        records = session.records
        cluster_hit_rate = mesh.stats()["hit_rate"]
        reusing = sum(1 for r in records if r.reused)
        title = "the reusing requests again, without the cache"
        err.print(title)
        with _progress(err, title, reusing) as progress:
            baseline = run_baseline(mesh, records, progress)
        out.print(comparison_table(records, baseline))
        mesh.check_integrity()
        status = mesh.stats()
    finally:
        mesh.shutdown()
    result = {
        **figures(records),
        **{k: v for k, v in comparison(records, baseline).items() if k != "requests"},
        "cross_tenant_hit_tokens": sum(r.cross_tenant for r in records),
        "cluster_hit_rate": round(cluster_hit_rate, 4),
        "phases": phases,
        "workers": len(workers),
        "model": cfg.model.name,
        "dashboard_url": status.get("dashboard_url"),
        "metrics_url": status.get("metrics_url"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    err.print(f"done in {result['seconds']:.0f}s; the mesh is stopped")
    return result


def _header(mesh: Any, out: Console, err: Console) -> None:
    status = mesh.stats()
    workers = ", ".join(sorted(mesh.workers))
    out.print(
        f"kvmesh demo: model {mesh.config.model.name}, workers {workers}, "
        f"{mesh.config.cache.page_tokens}-token pages"
    )
    if status.get("dashboard_url"):
        out.print(f"dashboard: {status['dashboard_url']} (live while the demo runs)")
    if status.get("metrics_url"):
        out.print(f"metrics:   {status['metrics_url']}")
    if len(mesh.workers) < 2:
        err.print("note: one worker only; nothing can be copied between workers")
    if not mesh.owned:
        err.print("note: attached to a running mesh; its figures include what it held before")
