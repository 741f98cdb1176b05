"""A worker's report (its figures, sent with each heartbeat) on the wire.

A WorkerReport travels as a list of its fields in order: page counts and byte counts as
ints, evictions as a map reason -> pages, tenants as [salt, requests, local_hit,
remote_hit, computed] rows, each histogram as [counts, total] with exactly one count per
bucket of its bounds (`messages.COPY_BUCKETS`, `messages.TTFT_BUCKETS`) plus +Inf.

The fields from the tiers on are optional, each sent only with those before it: a report
ends at its last field that is not empty (no tiers, zero decode figures, no routing
error observed), so a report without them reads as a report of a worker from before
them, and decodes with their defaults. The decode figures are counts; the routing error
is a histogram on `messages.ROUTE_ERROR_BUCKETS`. Each tier is a row of the TierFigures
fields in order (maps as maps, its load histogram on `messages.LOAD_BUCKETS`), named by
one of `messages.TIERS`, top down, each at most once.

Bounded beyond the frame limits: a report names at most MAX_REPORT_TENANTS salts,
MAX_REPORT_REASONS eviction reasons, len(TIERS) tiers and MAX_REPORT_REASONS reasons in each
of a tier's maps, since the service keeps the latest report of each worker and its metrics
carry those as labels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cache_service.messages import (
    COPY_BUCKETS,
    DECODE_FIELDS,
    HEALTH_FIELDS,
    LOAD_BUCKETS,
    LOAD_FIELDS,
    ROUTE_ERROR_BUCKETS,
    TIERS,
    TTFT_BUCKETS,
    Observed,
    TenantTokens,
    TierFigures,
    WorkerReport,
)
from cache_service.protocol.errors import TOO_LARGE, Limits, ProtocolError
from cache_service.protocol.fields import bad, check_count, check_id, check_list, check_str

MAX_REPORT_TENANTS = 1024
MAX_REPORT_REASONS = 16

_SCALARS = (
    "pages_free",
    "pages_cached",
    "pages_in_use",
    "copy_bytes_same_node",
    "copy_bytes_remote",
    "alignment_lost_tokens",
    *LOAD_FIELDS,
    *HEALTH_FIELDS,
)
_HISTOGRAMS = {"copy_seconds": COPY_BUCKETS, "ttft_hit": TTFT_BUCKETS, "ttft_miss": TTFT_BUCKETS}
_FIELDS = len(WorkerReport._fields)  # with every optional field
_REQUIRED = WorkerReport._fields.index("tiers")  # the fields before the optional ones
_TIER_SCALARS = (
    "pages",
    "capacity",
    "bytes_written",
    "bytes_read",
    "demotions",
    "hit_tokens",
    "read_ns_per_token",
    "errors",
)


def check_report(value: Any, path: str, limits: Limits) -> WorkerReport:
    """A decoded report, every count checked; raises ProtocolError naming the field."""
    if type(value) is not list or not _REQUIRED <= len(value) <= _FIELDS:
        raise bad(path, f"a report of {_REQUIRED} to {_FIELDS} fields", value)
    raw = dict(zip(WorkerReport._fields, value, strict=False))
    out: dict[str, Any] = {}
    for name in _SCALARS:
        out[name] = check_count(raw[name], f"{path}.{name}", limits)
    out["evictions"] = _check_reasons(raw["evictions"], f"{path}.evictions", limits)
    out["tenants"] = _check_tenants(raw["tenants"], f"{path}.tenants", limits)
    for name, bounds in _HISTOGRAMS.items():
        out[name] = _check_observed(raw[name], f"{path}.{name}", limits, bounds)
    if "tiers" in raw:
        out["tiers"] = _check_tiers(raw["tiers"], f"{path}.tiers", limits)
    for name in DECODE_FIELDS:
        if name in raw:
            out[name] = check_count(raw[name], f"{path}.{name}", limits)
    if "route_error" in raw:
        out["route_error"] = _check_observed(
            raw["route_error"], f"{path}.route_error", limits, ROUTE_ERROR_BUCKETS
        )
    return WorkerReport(**out)


def report_wire(value: Any) -> Any:
    """Wire form of a WorkerReport (anything else is left to the check, which refuses it)."""
    if not isinstance(value, WorkerReport):
        return value
    wire: list[Any] = []
    for name, item in zip(WorkerReport._fields, value, strict=True):
        if name == "evictions":
            wire.append(dict(item))
        elif name == "tenants":
            wire.append([list(row) for row in item])
        elif name in _HISTOGRAMS:
            wire.append(_observed_wire(item))
        elif name == "tiers":
            wire.append([_tier_wire(tier) for tier in item])
        elif name == "route_error":
            wire.append(None if item is None else _observed_wire(item))
        else:
            wire.append(item)
    # The optional fields go only as far as the last one that is not empty.
    while len(wire) > _REQUIRED and wire[-1] in ([], 0, None):
        wire.pop()
    return wire


def _tier_wire(tier: Any) -> Any:
    if not isinstance(tier, TierFigures):
        return tier  # the check refuses it
    wire: list[Any] = []
    for name, item in zip(TierFigures._fields, tier, strict=True):
        if name in ("evictions", "dropped"):
            wire.append(dict(item))
        elif name == "load_seconds":
            wire.append(_observed_wire(item))
        else:
            wire.append(item)
    return wire


def _observed_wire(item: Observed) -> list:
    return [list(item.counts), float(item.total)]


def _check_tiers(value: Any, path: str, limits: Limits) -> tuple[TierFigures, ...]:
    if type(value) is not list:
        raise bad(path, "a list of tiers", value)
    if len(value) > len(TIERS):
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} tiers exceeds the limit {len(TIERS)} {TIERS}"
        )
    tiers = [_check_tier(row, f"{path}[{i}]", limits) for i, row in enumerate(value)]
    order = [TIERS.index(tier.tier) for tier in tiers]
    if order != sorted(set(order)):
        named = [tier.tier for tier in tiers]
        raise bad(path, f"tiers top down {TIERS}, each at most once", named)
    return tuple(tiers)


def _check_tier(value: Any, path: str, limits: Limits) -> TierFigures:
    if type(value) is not list or len(value) != len(TierFigures._fields):
        raise bad(path, f"a tier of {len(TierFigures._fields)} fields", value)
    raw = dict(zip(TierFigures._fields, value, strict=True))
    if type(raw["tier"]) is not str or raw["tier"] not in TIERS:
        raise bad(f"{path}.tier", f"one of {TIERS}", raw["tier"])
    out: dict[str, Any] = {"tier": raw["tier"]}
    for name in _TIER_SCALARS:
        out[name] = check_count(raw[name], f"{path}.{name}", limits)
    for name in ("evictions", "dropped"):
        out[name] = _check_reasons(raw[name], f"{path}.{name}", limits)
    out["load_seconds"] = _check_observed(
        raw["load_seconds"], f"{path}.load_seconds", limits, LOAD_BUCKETS
    )
    if type(raw["accepting"]) is not int or raw["accepting"] not in (0, 1):
        raise bad(f"{path}.accepting", "0 or 1", raw["accepting"])
    out["accepting"] = raw["accepting"]
    return TierFigures(**out)


def _check_reasons(value: Any, path: str, limits: Limits) -> dict[str, int]:
    """A map reason -> pages (or records), at most MAX_REPORT_REASONS of them."""
    if type(value) is not dict:
        raise bad(path, "map of reason -> count", value)
    if len(value) > MAX_REPORT_REASONS:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} reasons exceeds the limit {MAX_REPORT_REASONS}"
        )
    return {
        check_id(reason, f"{path} key", limits): check_count(pages, f"{path}[{reason!r}]", limits)
        for reason, pages in value.items()
    }


def _check_tenants(value: Any, path: str, limits: Limits) -> tuple[TenantTokens, ...]:
    rows = check_list(value, path, limits)
    if len(rows) > MAX_REPORT_TENANTS:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(rows)} tenants exceeds the limit {MAX_REPORT_TENANTS}"
        )
    tenants = []
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path}[{i}]"
        if type(row) is not list or len(row) != len(TenantTokens._fields):
            raise bad(where, "[salt, requests, local_hit, remote_hit, computed]", row)
        salt = check_str(row[0], f"{where}.salt", limits.max_str_len, empty=True)
        if salt in seen:
            raise bad(f"{where}.salt", "a salt not reported twice", salt)
        seen.add(salt)
        counts = [
            check_count(n, f"{where}.{name}", limits)
            for n, name in zip(row[1:], TenantTokens._fields[1:], strict=True)
        ]
        tenants.append(TenantTokens(salt, *counts))
    return tuple(tenants)


def _check_observed(value: Any, path: str, limits: Limits, bounds: Sequence[float]) -> Observed:
    if type(value) is not list or len(value) != 2:
        raise bad(path, "[counts, total]", value)
    counts, total = value
    if type(counts) is not list or len(counts) != len(bounds) + 1:
        raise bad(f"{path}.counts", f"a list of {len(bounds) + 1} counts", counts)
    checked = tuple(check_count(n, f"{path}.counts[{i}]", limits) for i, n in enumerate(counts))
    if type(total) is int:
        total = float(total)
    if type(total) is not float or not math.isfinite(total) or total < 0:
        raise bad(f"{path}.total", "a finite float >= 0", total)
    return Observed(checked, total)
