"""What `kvmesh status` and `kvmesh top` show: one summary of the mesh, three views of it.

`summarize` folds the service's statistics and each worker's into the figures an operator
reads (`mesh.stats()` returns it, `kvmesh status --json` prints it):

    {"ray_address", "epoch", "service_address", "auth", "dashboard_url", "metrics_url",
     "hit_rate":        prompt tokens served from a cache (local or copied) / all,
     "index_hit_rate":  tokens the index found cached / tokens asked about,
     "prompt_tokens":   {"local_hit", "remote_hit", "computed"} over all workers,
     "pages":           {"total", "free", "cached", "in_use"} over all workers,
     "tiers":           {tier: "hit_tokens", "hit_rate" (of all prompt tokens), "pages",
                         "capacity", "bytes_written", "bytes_read", "demotions",
                         "evictions", "workers", "accepting", ...} from the service (top
                         down; {} from a service before tiers),
     "route_ttft_error": {"requests", "mean_s", "p50_within_s", "p90_within_s"}: how
                         far routed requests' first tokens came from the kvmesh policy's
                         estimate (the bucket bounds of `kvmesh_route_ttft_error_seconds`),
     "nodes":           {node id: {"address", "workers": [worker ids]}},
     "workers":         {worker id: the worker's own figures + "alive", "pages", "hit_rate"},
     "engines":         {worker id: "live", "node", "address", "queries",
                         "queried_tokens", "hit_tokens", "hit_rate", "pages"} for engines
                         that joined (vLLM); "node" is None once it is gone,
     "tenants":         {tenant name: the index's counters + "hit_rate"},
     "service":         the service's statistics as it reports them}

A worker that did not answer appears as {"alive": False, "error": ...}. `render_status`
draws the summary as text tables and `top_view` as the live view of `kvmesh top`, both
with rich.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

PAGE_STATES = ("total", "free", "cached", "in_use")
SOURCES = ("local_hit", "remote_hit", "computed")
ENGINE_FIGURES = ("queries", "queried_tokens", "hit_tokens", "pages")


def summarize(
    service: Mapping[str, Any],
    workers: Mapping[str, Mapping[str, Any]],
    nodes: Mapping[str, str],
    ray_address: str,
    auth: bool,
) -> dict[str, Any]:
    """The status of a mesh from its parts.

    Args:
        service: the service's statistics ({"unavailable": True, ...} when unreachable).
        workers: worker id -> its `stats()`, or {"alive": False, "error": ...}.
        nodes: node id -> address, for the cluster's live nodes.
        ray_address: the Ray cluster's GCS address.
        auth: whether the mesh authenticates its clients and peers.
    """
    pages = dict.fromkeys(PAGE_STATES, 0)
    served = dict.fromkeys(SOURCES, 0)
    by_node: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for worker_id, figures in sorted(workers.items()):
        if figures.get("alive") is False:
            rows[worker_id] = dict(figures)
            continue
        cache = figures["cache"]
        own = {state: cache[f"{state}_pages"] for state in PAGE_STATES}
        tokens = figures["prompt_tokens"]
        for state in PAGE_STATES:
            pages[state] += own[state]
        for source in SOURCES:
            served[source] += tokens[source]
        rows[worker_id] = {
            **figures,
            "alive": True,
            "pages": own,
            "hit_rate": _served_rate(tokens),
        }
        node = by_node.setdefault(
            figures["node"], {"address": nodes.get(figures["node"], "?"), "workers": []}
        )
        node["workers"].append(worker_id)
    cluster = service.get("cluster", {})
    # Engines: workers of the index that the launcher did not start (vLLM engines that
    # joined through Ray), with what the index knows of them.
    engines = {
        worker_id: {
            **{key: tally.get(key, 0) for key in ENGINE_FIGURES},
            "live": bool(tally.get("live")),
            "node": tally.get("node"),
            "address": nodes.get(tally.get("node"), "?"),
            "hit_rate": _rate(tally.get("hit_tokens", 0), tally.get("queried_tokens", 0)),
        }
        for worker_id, tally in sorted(service.get("workers", {}).items())
        if worker_id not in workers
    }
    return {
        "ray_address": ray_address,
        "epoch": service.get("service", {}).get("epoch"),
        "service_address": service.get("service", {}).get("address"),
        "auth": auth,
        "dashboard_url": service.get("service", {}).get("dashboard_url"),
        "metrics_url": service.get("service", {}).get("metrics_url"),
        "hit_rate": _served_rate(served),
        "index_hit_rate": _rate(cluster.get("hit_tokens", 0), cluster.get("queried_tokens", 0)),
        "prompt_tokens": served,
        "pages": pages,
        "tiers": dict(service.get("served", {}).get("tiers", {})),
        "route_ttft_error": dict(service.get("served", {}).get("route_ttft_error", {})),
        "nodes": by_node,
        "workers": rows,
        "engines": engines,
        "tenants": {
            name: {**tally, "hit_rate": _rate(tally["hit_tokens"], tally["queried_tokens"])}
            for name, tally in service.get("tenants", {}).items()
        },
        # members whose pages failed a spot check: holder, reporter, since, evidence
        "quarantined": list(service.get("quarantine", {}).get("members", [])),
        "service": dict(service),
    }


def render_status(status: Mapping[str, Any], width: int = 120) -> str:
    """`kvmesh status` as text: the mesh, its workers per node, its tenants."""
    return render(top_view(status), width)


def render(renderable: RenderableType, width: int = 120) -> str:
    """A rich renderable as plain text (no colour codes)."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(renderable)
    return out.getvalue()


def top_view(status: Mapping[str, Any], refreshed: str | None = None) -> RenderableType:
    """The mesh as tables: a headline, the workers by node, the tenants."""
    pages = status["pages"]
    tokens = status["prompt_tokens"]
    headline = Text.assemble(
        ("kvmesh", "bold"),
        f"  ray {status['ray_address']}  service {status['service_address']}"
        f"  epoch {status['epoch']}",
        f"  auth {'on' if status['auth'] else 'off'}",
        f"  (refreshed {refreshed})" if refreshed else "",
        "\n",
        f"hit rate {_percent(status['hit_rate'])} of prompt tokens "
        f"(local {tokens['local_hit']}, copied {tokens['remote_hit']}, "
        f"computed {tokens['computed']});  index hit rate {_percent(status['index_hit_rate'])}",
        "\n",
        f"pages {pages['in_use']} in use, {pages['cached']} cached, {pages['free']} free "
        f"of {pages['total']}",
        *((f"\n{tiers_line(status['tiers'])}",) if status.get("tiers") else ()),
        *(
            (f"\n{name} {status[key]}",)
            for key, name in (("dashboard_url", "dashboard"), ("metrics_url", "metrics"))
            if status.get(key)
        ),
        *(
            (f"\nin quarantine: {r['holder']} (reported by {r['reporter']}: {r['evidence']})",)
            for r in status.get("quarantined", ())
        ),
    )
    tables = [_workers_table(status)]
    if status.get("engines"):
        tables.append(_engines_table(status))
    return Group(headline, *tables, _tenants_table(status))


def run_top(
    fetch: Callable[[], Mapping[str, Any]],
    interval_s: float = 1.0,
    console: Console | None = None,
    iterations: int | None = None,
) -> None:
    """Redraw `top_view(fetch())` every `interval_s` until interrupted (or `iterations`)."""
    count = 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while iterations is None or count < iterations:
            live.update(top_view(fetch(), time.strftime("%H:%M:%S")), refresh=True)
            count += 1
            if iterations is None or count < iterations:
                time.sleep(interval_s)


def _workers_table(status: Mapping[str, Any]) -> Table:
    table = Table(title="workers by node", box=box.SIMPLE, title_justify="left")
    table.add_column("node", no_wrap=True)
    table.add_column("worker", no_wrap=True)
    table.add_column("page server", no_wrap=True)
    for name in ("requests", "hit rate", "local", "copied", "computed", "pages u/c/f"):
        table.add_column(name, justify="right")
    table.add_column("served", justify="right")
    workers = status["workers"]
    placed = set()
    for node_id, node in sorted(status["nodes"].items(), key=lambda item: item[1]["address"]):
        for worker_id in node["workers"]:
            placed.add(worker_id)
            w = workers[worker_id]
            tokens, pages = w["prompt_tokens"], w["pages"]
            table.add_row(
                f"{node['address']} {node_id[:8]}",
                _worker_name(worker_id, w.get("serving", {})),
                w["address"],
                str(w["requests"]),
                _percent(w["hit_rate"]),
                str(tokens["local_hit"]),
                str(tokens["remote_hit"]),
                str(tokens["computed"]),
                f"{pages['in_use']}/{pages['cached']}/{pages['free']}",
                str(w["pages_served"]),
            )
    for worker_id in sorted(set(workers) - placed):
        error = str(workers[worker_id].get("error", ""))
        table.add_row("?", worker_id, f"not alive: {error[:80]}")
    return table


def _worker_name(worker_id: str, serving: Mapping[str, Any]) -> str:
    """The worker's id, marked when its serving loop does not run or has restarted."""
    if serving.get("serving", True) is False:
        return f"{worker_id} (not serving)"
    if serving.get("restarts"):
        return f"{worker_id} ({serving['restarts']} loop restarts)"
    return worker_id


def _engines_table(status: Mapping[str, Any]) -> Table:
    table = Table(
        title="engines (joined through Ray, as the index saw them)",
        box=box.SIMPLE,
        title_justify="left",
    )
    table.add_column("engine", no_wrap=True)
    table.add_column("node", no_wrap=True)
    for name in ("live", "queries", "tokens", "hit rate", "pages held"):
        table.add_column(name, justify="right")
    for worker_id, e in status["engines"].items():
        node = e.get("node")
        table.add_row(
            worker_id,
            "-" if node is None else f"{e.get('address', '?')} ({node[:8]})",
            "yes" if e["live"] else "no",
            str(e["queries"]),
            str(e["queried_tokens"]),
            _percent(e["hit_rate"]),
            str(e["pages"]),
        )
    return table


def _tenants_table(status: Mapping[str, Any]) -> Table:
    table = Table(title="tenants (as the index saw them)", box=box.SIMPLE, title_justify="left")
    for name in ("tenant", "queries", "tokens", "hit rate", "local", "remote", "missed"):
        table.add_column(name, justify="left" if name == "tenant" else "right")
    for name, t in sorted(status["tenants"].items()):
        table.add_row(
            name,
            str(t["queries"]),
            str(t["queried_tokens"]),
            _percent(t["hit_rate"]),
            str(t["local_hit_tokens"]),
            str(t["remote_hit_tokens"]),
            str(t["miss_tokens"]),
        )
    return table


def tiers_line(tiers: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for the tiers, top down: pages held of capacity, the share of prompt tokens
    each served, and what went through it where its workers report that, e.g.

        tiers: host 96/128 pages, 41.2% of prompt tokens; disk 900/4096 pages, 12.5% of
        prompt tokens, 3.0 MiB written, 1.5 MiB read, 48 demotions, 2 of 2 accepting
    """
    parts = []
    for tier, t in tiers.items():
        text = (
            f"{tier} {t['pages']}/{t['capacity']} pages, {_percent(t['hit_rate'])} of prompt tokens"
        )
        if t.get("workers"):  # workers report its own figures
            text += (
                f", {_bytes(t['bytes_written'])} written, {_bytes(t['bytes_read'])} read, "
                f"{t['demotions']} demotions, {t['accepting']} of {t['workers']} accepting"
            )
            if t.get("errors"):
                text += f", {t['errors']} errors"
        parts.append(text)
    return "tiers: " + "; ".join(parts)


def _bytes(count: int | None) -> str:
    """Bytes in binary units, as the dashboard shows them ("512 B", "1.5 MiB")."""
    if count is None:
        return "?"
    value, unit = float(count), 0
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{count} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def _served_rate(tokens: Mapping[str, int]) -> float:
    return _rate(tokens["local_hit"] + tokens["remote_hit"], sum(tokens[s] for s in SOURCES))


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _percent(rate: float) -> str:
    return f"{100 * rate:.1f}%"
