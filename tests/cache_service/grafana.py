"""The Grafana dashboard (configs/grafana/kvmesh.json) as PromQL a test can send to Prometheus.

Grafana fills in its variables before it queries; `grafana_expressions` does the same, the
way a viewer who leaves every variable on "All" and a Prometheus scraping every second see
it, so each expression can be run through a PrometheusRig as Grafana would run it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvmesh.json"
CLUSTER_HIT_RATE = "Cluster hit rate"  # the panel whose figure the service reports too

# What Grafana puts for its interval variables with a 1 s scrape: $__interval follows the
# time range over the panel's width (15 min over a few hundred points is a few seconds), and
# $__rate_interval is kept well above the scrape interval so rate() always finds two samples.
RATE_INTERVAL = "15s"
INTERVAL = "5s"

# $name, ${name}, ${name:format} and the older [[name]]; `\w` covers the `__` of built-ins.
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]")
_METRIC = re.compile(r"kvmesh_[a-z_]+")


class PanelExpression(NamedTuple):
    title: str  # the panel's title
    expr: str  # one of its targets' PromQL, with the variables filled in


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    """The dashboard JSON as a dict."""
    return json.loads(Path(path).read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those folded into a collapsed row (rows themselves too)."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """What each templating variable stands for when "All" is selected (its allValue).

    Raises:
        ValueError: a variable with no "All" option, or one without an allValue (Grafana
            would then list every value it found, which a test cannot know beforehand).
    """
    values = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        name = variable["name"]
        if not variable.get("includeAll") or not variable.get("allValue"):
            raise ValueError(f"variable ${name} has no 'All' option with an allValue")
        values[name] = variable["allValue"]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with each Grafana variable replaced by its value in `values`.

    Raises:
        KeyError: a variable `values` has no value for.
    """

    def value(match: re.Match) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def grafana_expressions(
    dashboard: dict[str, Any], rate_interval: str = RATE_INTERVAL, interval: str = INTERVAL
) -> list[PanelExpression]:
    """Every (panel title, expr) of the dashboard, in panel order, with its variables on
    "All" ($worker, $tenant -> ".*") and $__rate_interval, $__interval as given.

    A panel with several targets gives one entry per target; hidden targets are included.

    Raises:
        KeyError: an expression uses a variable the dashboard does not define.
        ValueError: a variable has no "All" value (see all_values).
    """
    values = {
        **all_values(dashboard),
        "__rate_interval": rate_interval,
        "__interval": interval,
    }
    return [
        PanelExpression(panel["title"], substitute(target["expr"], values))
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def metric_names(expr: str) -> set[str]:
    """The kvmesh_ metric names `expr` mentions, as written (histogram suffixes kept)."""
    return set(_METRIC.findall(expr))
