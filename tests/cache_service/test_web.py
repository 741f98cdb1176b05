"""The service's HTTP port beyond /metrics: the dashboard's routes, headers and access
token over HTTP, and the page itself in a headless Chromium against known figures."""

from __future__ import annotations

import html.parser
import http.client
import importlib.resources
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client import CollectorRegistry

from cache_service import web
from cache_service.web import CONTENT_SECURITY_POLICY, WebServer
from tests import browser as harness
from tests.browser import (
    console_log,
    open_browser,
    resource_urls,
    save_screenshot,
    wait_for_js,
)

TOKEN = "s3cret; +/=x"  # a cookie's and a query's special characters, to be carried intact
PAGE_FILES = importlib.resources.files("cache_service") / "dashboard"


# ---- HTTP helpers ----------------------------------------------------------------------


class Reply(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the test looks at the 302 itself


_OPENER = urllib.request.build_opener(_NoRedirects)


def get(url: str, data: bytes | None = None, **headers: str) -> Reply:
    """The reply to a GET (a POST with `data`), whatever its status."""
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _OPENER.open(request, timeout=5) as reply:
            return Reply(reply.status, dict(reply.headers), reply.read())
    except urllib.error.HTTPError as error:
        with error:
            return Reply(error.code, dict(error.headers), error.read())


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def in_query(token: str = TOKEN) -> str:
    return urllib.parse.urlencode({"token": token})


class Feed:
    """A dashboard callable serving `state` (the test may swap it, or make it an exception
    to raise); counts its calls."""

    def __init__(self, state: dict | Exception) -> None:
        self.state = state
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        if isinstance(self.state, Exception):
            raise self.state
        return self.state


class Ports(NamedTuple):
    """The module's servers on 127.0.0.1 (one each: stopping one takes half a second)."""

    feed: Feed  # what `open` and `guarded` serve
    open: WebServer  # no token
    guarded: WebServer  # TOKEN
    bare: WebServer  # no token and no dashboard


@pytest.fixture(scope="module")
def _ports() -> Iterator[Ports]:
    feed = Feed(FIRST)
    servers = [
        WebServer(CollectorRegistry(), "127.0.0.1", token=token, dashboard=dashboard)
        for token, dashboard in (("", feed), (TOKEN, feed), ("", None))
    ]
    for server in servers:
        server.start()
    yield Ports(feed, *servers)
    for server in servers:
        server.stop()


@pytest.fixture
def ports(_ports: Ports) -> Ports:
    """The module's servers, their feed back at FIRST."""
    _ports.feed.state = FIRST
    _ports.feed.calls = 0
    return _ports


# ---- known figures, by the contract of /api/dashboard ------------------------------------

T0 = 1764589990.0


def point(t, requests, local, remote, computed, hit=(0, 0.0), miss=(0, 0.0), evictions=0):
    return {
        "t": T0 + t,
        "requests": requests,
        "local_hit": local,
        "remote_hit": remote,
        "computed": computed,
        "ttft_hit": {"count": hit[0], "sum": hit[1]},
        "ttft_miss": {"count": miss[0], "sum": miss[1]},
        "evictions": evictions,
    }


def tokens(name_key, name, requests, local, remote, computed) -> dict:
    total = local + remote + computed
    rate = (local + remote) / total if total else 0.0
    return {
        name_key: name,
        "requests": requests,
        "local_hit": local,
        "remote_hit": remote,
        "computed": computed,
        "hit_rate": rate,
    }


def worker(name, live, figures, pages, evictions) -> dict:
    row = tokens("worker", name, *figures)
    row.update(live=live, pages=dict(zip(("free", "cached", "in_use"), pages, strict=True)))
    row["evictions"] = evictions
    return row


def ttft(hit, miss) -> dict:
    def summary(count, total):
        return {"count": count, "sum": total, "buckets": [[0.5, count], ["+Inf", count]]}

    return {"hit": summary(*hit), "miss": summary(*miss)}


def tier_row(tier, hit_tokens, served, pages, capacity, evictions, **own) -> dict:
    """A row of "tiers"; `own`: the figures of workers that report the tier (none: null)."""
    counters = ("workers", "accepting", "bytes_written", "bytes_read", "demotions", "errors")
    row = {
        "tier": tier,
        "hit_tokens": hit_tokens,
        "hit_rate": hit_tokens / served,
        "pages": pages,
        "capacity": capacity,
        "evictions": evictions,
        **{name: own.get(name) for name in counters},
        "dropped": own.get("dropped"),
    }
    row["workers"] = row["workers"] or 0
    row["accepting"] = row["accepting"] or 0
    return row


def dashboard(epoch, workers, tenants, history, ttft_figures, quarantined=(), tiers=()) -> dict:
    figures = [sum(w[key] for w in workers) for key in ("local_hit", "remote_hit", "computed")]
    totals = tokens("-", "", sum(w["requests"] for w in workers), *figures)
    del totals["-"]
    evictions: dict[str, int] = {}
    for w in workers:
        for reason, pages in w["evictions"].items():
            evictions[reason] = evictions.get(reason, 0) + pages
    return {
        "now": history[-1]["t"] if history else T0,
        "epoch": epoch,
        "workers_live": sum(w["live"] for w in workers),
        "totals": totals,
        "history": history,
        "workers": workers,
        "tenants": tenants,
        "evictions": evictions,
        "ttft": ttft_figures,
        "quarantined": list(quarantined),
        "tiers": list(tiers),
    }


FIRST = dashboard(
    epoch=3,
    workers=[
        worker("w0", True, (20, 2500, 600, 3500), (100, 30, 2), {"evicted": 12}),
        worker("w1", True, (18, 2300, 500, 3400), (90, 40, 1), {"evicted": 3}),
    ],
    tenants=[tokens("tenant", "acme", 38, 4800, 1100, 6900)],
    history=[point(0, 30, 4000, 900, 6000), point(1, 38, 4800, 1100, 6900)],
    ttft_figures=ttft((20, 3.1), (18, 21.0)),
)

# Three workers (one down), names that look like markup or numbers, and a history with an
# idle second (no tokens: no interval hit rate) and a counter reset (a restarted worker).
SECOND = dashboard(
    epoch=4,
    workers=[
        worker("w0", True, (31, 4100, 900, 5000), (80, 45, 7), {"evicted": 20, "expired": 4}),
        worker("<i>w1</i>", True, (25, 1000, 1500, 2500), (60, 70, 2), {"evicted": 5}),
        worker("7", False, (3, 0, 0, 400), (128, 0, 0), {}),
    ],
    tenants=[
        tokens("tenant", "acme", 40, 5000, 1200, 7000),
        tokens("tenant", "<b>x</b>", 19, 100, 1200, 900),
        tokens("tenant", "idle", 0, 0, 0, 0),
    ],
    history=[
        point(0, 50, 9000, 2000, 6000, hit=(30, 4.5), miss=(20, 24.0), evictions=20),
        point(1, 55, 9600, 2300, 6600, hit=(34, 5.1), miss=(22, 26.2), evictions=24),
        point(2, 55, 9600, 2300, 6600, hit=(34, 5.1), miss=(22, 26.2), evictions=24),
        point(3, 58, 700, 2400, 7000, hit=(36, 5.4), miss=(25, 29.5), evictions=26),  # reset
        point(4.5, 59, 5100, 2400, 7900, hit=(2, 0.3), miss=(1, 1.2), evictions=29),
    ],
    ttft_figures=ttft((36, 5.4), (25, 29.5)),
    quarantined=[
        {"holder": "<i>w9</i>", "reporter": "w0", "since": T0, "evidence": "page 3: 0.81"}
    ],
    # Of the 5100 local hits, 1100 came from disk; the 2400 remote hits count for host.
    # Host memory: no worker reports figures of its own for it (null: shown as "–").
    tiers=[
        tier_row("host", 4000 + 2400, 15400, 122, 384, {"evicted": 25, "expired": 4}),
        tier_row(
            "disk",
            1100,
            15400,
            900,
            4096,
            {"evicted": 20, "corrupt": 2},
            workers=2,
            accepting=1,
            bytes_written=7 << 19,  # 3.5 MiB
            bytes_read=1536,
            demotions=900,
            errors=3,
            dropped={"truncated": 1, "orphan": 2},
        ),
    ],
)


# ---- what the page should draw, worked out here independently ----------------------------


def increase(before: float, after: float) -> float:
    return after if after < before else after - before


def intervals(history: list[dict]) -> list[dict]:
    steps = []
    for a, b in pairs(history):
        dt = b["t"] - a["t"]
        local, remote, computed = (
            increase(a[key], b[key]) for key in ("local_hit", "remote_hit", "computed")
        )
        total = local + remote + computed
        steps.append(
            {
                "dt": dt,
                "local": local,
                "remote": remote,
                "computed": computed,
                "rate": (local + remote) / total if total else None,
            }
        )
    return steps


def pairs(history: list[dict]) -> list[tuple[dict, dict]]:
    return list(zip(history, history[1:], strict=False))


def mean_increase(before: dict, after: dict) -> float | None:
    reset = after["count"] < before["count"]
    count = after["count"] if reset else after["count"] - before["count"]
    total = after["sum"] if reset else after["sum"] - before["sum"]
    return total / count if count else None


def cumulative_rate(p: dict) -> float | None:
    total = p["local_hit"] + p["remote_hit"] + p["computed"]
    return (p["local_hit"] + p["remote_hit"]) / total if total else None


def integer(value) -> str:
    return str(round(value))


def percent(rate: float) -> str:
    # as JavaScript's toFixed rounds: the exact binary value, a tie going up
    return f"{Decimal(100 * rate).quantize(Decimal('0.1'), rounding=ROUND_HALF_UP)}%"


def token_cells(row: dict) -> dict[str, str]:
    return {
        "name": row.get("tenant", row.get("worker")),
        "requests": integer(row["requests"]),
        "local-hit": integer(row["local_hit"]),
        "remote-hit": integer(row["remote_hit"]),
        "computed": integer(row["computed"]),
        "hit-rate": percent(row["hit_rate"]),
    }


def worker_cells(row: dict) -> dict[str, str]:
    return {
        **token_cells(row),
        "live": "yes" if row["live"] else "no",
        "pages-free": integer(row["pages"]["free"]),
        "pages-cached": integer(row["pages"]["cached"]),
        "pages-in-use": integer(row["pages"]["in_use"]),
    }


def byte_count(value) -> str:
    if value is None:
        return "–"
    units, unit = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def tier_cells(row: dict) -> dict[str, str]:
    def count(value) -> str:
        return "–" if value is None else integer(value)

    return {
        "name": row["tier"],
        "pages": integer(row["pages"]),
        "capacity": integer(row["capacity"]),
        "hit-tokens": integer(row["hit_tokens"]),
        "hit-share": percent(row["hit_rate"]),
        "written": byte_count(row["bytes_written"]),
        "read": byte_count(row["bytes_read"]),
        "demotions": count(row["demotions"]),
        "evictions": integer(sum(row["evictions"].values())),
        "accepting": f"{row['accepting']} of {row['workers']}" if row["workers"] else "–",
        "dropped": count(row["dropped"] and sum(row["dropped"].values())),
        "errors": count(row["errors"]),
    }


def test_the_worked_figures_are_what_the_contract_says():
    # The reference the browser test holds the page to, pinned by hand.
    steps = intervals(SECOND["history"])
    assert [s["rate"] for s in steps] == [
        pytest.approx(900 / 1500),
        None,  # an idle second
        pytest.approx(800 / 1200),  # local_hit fell to 700: the 700 count
        pytest.approx(4400 / 5300),
    ]
    assert [s["local"] / s["dt"] for s in steps] == [600.0, 0.0, 700.0, 4400 / 1.5]
    assert SECOND["totals"]["requests"] == 59
    assert SECOND["evictions"] == {"evicted": 25, "expired": 4}
    assert SECOND["totals"]["hit_rate"] == 7500 / 15400
    assert percent(7500 / 15400) == "48.7%"
    assert percent(0.0625) == "6.3%" and percent(0.5) == "50.0%"  # 6.25 is a tie: up
    ttft_hit = [mean_increase(a["ttft_hit"], b["ttft_hit"]) for a, b in pairs(SECOND["history"])]
    assert ttft_hit == [pytest.approx(0.15), None, pytest.approx(0.15), pytest.approx(0.15)]
    host, disk = SECOND["tiers"]
    assert host["hit_rate"] + disk["hit_rate"] == pytest.approx(SECOND["totals"]["hit_rate"])
    assert tier_cells(disk) == {
        "name": "disk",
        "pages": "900",
        "capacity": "4096",
        "hit-tokens": "1100",
        "hit-share": "7.1%",
        "written": "3.5 MiB",
        "read": "1.5 KiB",
        "demotions": "900",
        "evictions": "22",
        "accepting": "1 of 2",
        "dropped": "3",
        "errors": "3",
    }
    assert [tier_cells(host)[k] for k in ("written", "accepting", "dropped")] == ["–"] * 3


# ---- routes and headers ----------------------------------------------------------------


def test_the_page_and_its_files_are_served_with_their_types(ports):
    server = ports.open
    page = get(server.url + "/dashboard")
    assert page.status == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert "Set-Cookie" not in page.headers  # no token, nothing to remember
    assert page.body == (PAGE_FILES / "index.html").read_bytes()
    for name, content_type in (
        ("dashboard.js", "text/javascript; charset=utf-8"),
        ("dashboard.css", "text/css; charset=utf-8"),
    ):
        reply = get(f"{server.url}/static/{name}")
        assert (reply.status, reply.headers["Content-Type"]) == (200, content_type)
        assert reply.headers["X-Content-Type-Options"] == "nosniff"
        assert reply.body == (PAGE_FILES / name).read_bytes()


def test_the_page_runs_no_inline_script_and_loads_nothing_from_elsewhere():
    tags = _Tags()
    tags.feed((PAGE_FILES / "index.html").read_text())
    scripts = [attrs for tag, attrs in tags.seen if tag == "script"]
    assert [s["src"] for s in scripts] == ["static/plotly.min.js", "static/dashboard.js"]
    assert not tags.script_text.strip()
    assert not any(k.startswith("on") for _, attrs in tags.seen for k in attrs)  # no onload=
    links = [attrs.get("src") or attrs.get("href") for _, attrs in tags.seen]
    assert all(":" not in link or link == "data:," for link in links if link), links
    assert "http" not in (PAGE_FILES / "dashboard.js").read_text()


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.script_text = ""
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.seen.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.script_text += data


def test_plotly_comes_from_the_python_package_and_is_cached_an_hour(ports):
    server = ports.bare
    reply = get(server.url + "/static/plotly.min.js")
    shipped = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert reply.headers["Cache-Control"] == "max-age=3600"
    assert reply.headers["X-Content-Type-Options"] == "nosniff"
    assert len(reply.body) > 1_000_000 and reply.body == shipped
    assert b"plotly.js v" in reply.body[:200]


def test_without_plotly_the_bundle_is_a_500_that_names_the_package(ports, monkeypatch):
    monkeypatch.setattr(web, "PLOTLY_PACKAGE", "kvmesh_no_such_package")
    server = ports.bare
    reply = get(server.url + "/static/plotly.min.js")
    assert reply.status == 500
    assert b"'kvmesh_no_such_package'" in reply.body
    assert b"pip install kvmesh_no_such_package" in reply.body


def test_the_api_serves_what_the_dashboard_callable_returns(ports):
    # With the token: the whole reply, tenant rows included (without a token the port
    # serves it without them: tests/security/test_metrics_port.py).
    server, feed = ports.guarded, ports.feed
    feed.state = SECOND
    reply = get(server.url + "/api/dashboard", **bearer())
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "application/json"
    assert reply.headers["Cache-Control"] == "no-store"
    assert json.loads(reply.body) == SECOND
    assert feed.calls == 1
    feed.state = FIRST
    assert json.loads(get(server.url + "/api/dashboard", **bearer()).body) == FIRST
    assert json.loads(get(ports.open.url + "/api/dashboard").body) == {**FIRST, "tenants": []}


def test_a_failing_or_unserialisable_dashboard_is_a_500_with_the_reason(ports):
    server, feed = ports.open, ports.feed
    feed.state = RuntimeError("the snapshot is gone")
    reply = get(server.url + "/api/dashboard")
    assert reply.status == 500 and b"the snapshot is gone" in reply.body
    feed.state = {"totals": {"hit_rate": math.nan}}
    reply = get(server.url + "/api/dashboard")
    assert reply.status == 500 and b"not JSON compliant" in reply.body
    assert get(server.url + "/metrics").status == 200  # the port goes on serving


def test_without_a_dashboard_the_api_is_404_and_the_page_still_renders(ports):
    server = ports.bare
    assert get(server.url + "/api/dashboard").status == 404
    assert get(server.url + "/dashboard").status == 200


def test_the_root_redirects_to_the_page_with_its_query(ports):
    server = ports.bare
    reply = get(server.url + "/")
    assert (reply.status, reply.headers["Location"]) == (302, "/dashboard")
    reply = get(server.url + "/?interval=0.5&token=t")
    assert (reply.status, reply.headers["Location"]) == (302, "/dashboard?interval=0.5&token=t")


@pytest.mark.parametrize(
    "path",
    [
        "/nothing",
        "/dashboard/",
        "/index.html",
        "/static/",
        "/static/index.html",
        "/static/nothing.js",
        "/static/../web.py",
        "/static/%2e%2e/web.py",
        "/api",
        "/api/dashboard/x",
        "dashboard.js",
    ],
)
def test_anything_else_is_404(ports, path):
    server = ports.open
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", path)
        assert connection.getresponse().status == 404
    finally:
        connection.close()


def test_only_get_is_served(ports):
    server = ports.open
    assert get(server.url + "/api/dashboard", data=b"{}").status == 501


# ---- the access token --------------------------------------------------------------------

ROUTES = ["/", "/dashboard", "/api/dashboard", "/static/dashboard.js", "/metrics", "/nothing"]


def test_with_a_token_set_every_route_refuses_a_request_without_it(ports):
    server = ports.guarded
    for path in ROUTES:
        reply = get(server.url + path)
        assert (path, reply.status) == (path, 401)
        assert reply.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("way", ["bearer", "cookie", "query"])
def test_the_token_admits_as_a_bearer_a_cookie_or_a_query(ports, way):
    server = ports.guarded
    cookie = {"Cookie": f"theme=dark; kvmesh_token={urllib.parse.quote(TOKEN, safe='')}"}
    headers, query = {"bearer": (bearer(), ""), "cookie": (cookie, ""), "query": ({}, "")}[way]
    if way == "query":
        query = "?" + in_query()
    expected = {"/": 302, "/nothing": 404}
    for path in ROUTES:
        reply = get(server.url + path + query, **headers)
        assert (path, reply.status) == (path, expected.get(path, 200))
    assert json.loads(get(server.url + "/api/dashboard" + query, **headers).body) == FIRST


@pytest.mark.parametrize(
    "wrong",
    [
        bearer("guess"),
        {"Authorization": TOKEN},  # the token without its scheme
        {"Cookie": "kvmesh_token=guess"},
        {"Cookie": f"other={urllib.parse.quote(TOKEN, safe='')}"},
        {"Cookie": f"kvmesh_token={TOKEN}"},  # not as the cookie carries it: cut at ";"
    ],
)
def test_a_wrong_token_is_refused(ports, wrong):
    server = ports.guarded
    assert get(server.url + "/api/dashboard", **wrong).status == 401


def test_a_wrong_token_in_the_query_is_refused(ports):
    server = ports.guarded
    for query in (in_query("guess"), in_query(TOKEN[:-1]), "token=", "t" + in_query()):
        assert get(f"{server.url}/dashboard?{query}").status == 401


def test_the_token_in_the_pages_query_is_kept_in_an_http_only_cookie(ports):
    server = ports.guarded
    page = get(f"{server.url}/dashboard?interval=2&{in_query()}")
    assert page.status == 200
    cookie = page.headers["Set-Cookie"]
    quoted = urllib.parse.quote(TOKEN, safe="")
    assert cookie == f"kvmesh_token={quoted}; HttpOnly; SameSite=Strict; Path=/"
    carried = {"Cookie": cookie.split(";", 1)[0]}
    assert json.loads(get(server.url + "/api/dashboard", **carried).body) == FIRST
    # admitted another way, the page sets no cookie
    assert "Set-Cookie" not in get(server.url + "/dashboard", **bearer()).headers
    assert "Set-Cookie" not in get(server.url + "/dashboard", **carried).headers
    assert "Set-Cookie" not in get(f"{server.url}/api/dashboard?{in_query()}").headers


# ---- the page in a browser ---------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with open_browser() as driver:
        yield driver


@pytest.fixture
def page(browser):
    """The module's browser, its cookies and console cleared after the test."""
    yield browser
    browser.delete_all_cookies()
    browser.get("about:blank")
    browser.get_log("browser")


def js(driver, expression: str):
    return driver.execute_script(f"return ({expression});")


def traces(driver, chart: str) -> list[dict]:
    assert js(driver, f"document.getElementById('{chart}').classList.contains('js-plotly-plot')")
    return js(
        driver,
        f"document.getElementById('{chart}').data"
        ".map((t) => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)}))",
    )


def rows(driver, table: str, key: str) -> dict[str, dict[str, str]]:
    """{data-<key>: {cell class: text}} of the rows of `table`."""
    script = f"""Object.fromEntries(
        Array.from(document.querySelectorAll('#{table} tbody tr')).map((tr) => [
            tr.dataset.{key},
            Object.fromEntries(Array.from(tr.cells).map((td) => [td.className, td.textContent])),
        ]))"""
    return js(driver, script)


def wait_for_updates(driver, count: int) -> None:
    wait_for_js(driver, f"Number(document.getElementById('updated').dataset.updates) >= {count}")


@pytest.mark.slow
def test_the_page_shows_the_figures_it_is_served(ports, page):
    server, feed = ports.guarded, ports.feed
    page.get(f"{server.url}/dashboard?{in_query()}&interval=0.1")
    wait_for_updates(page, 2)
    assert js(page, "document.getElementById('requests').textContent") == "38"
    assert js(page, "document.getElementById('epoch').textContent") == "3"
    assert js(page, "document.getElementById('quarantine-card').hidden")  # none in FIRST
    assert js(page, "document.getElementById('tiers-card').hidden")  # nor tiers
    assert "token" not in page.current_url  # kept in the cookie, out of the address bar

    feed.state = SECOND
    wait_for_js(page, "window.kvmeshDashboard.last.epoch === 4")
    assert js(page, "window.kvmeshDashboard.last") == SECOND
    assert js(page, "window.kvmeshDashboard.updates") >= 3
    updated = js(page, "document.getElementById('updated').textContent")
    assert updated.startswith("updated ")

    totals = SECOND["totals"]
    headline = {
        "requests": integer(totals["requests"]),
        "hit-rate": percent(totals["hit_rate"]),
        "local-hit-tokens": integer(totals["local_hit"]),
        "remote-hit-tokens": integer(totals["remote_hit"]),
        "computed-tokens": integer(totals["computed"]),
        "workers-live": "2",
        "epoch": "4",
    }
    shown = {key: js(page, f"document.getElementById('{key}').textContent") for key in headline}
    assert shown == headline == {**headline, "requests": "59", "hit-rate": "48.7%"}
    assert js(page, "document.getElementById('error').hidden")

    tenants, workers = SECOND["tenants"], SECOND["workers"]
    assert rows(page, "tenants", "tenant") == {t["tenant"]: token_cells(t) for t in tenants}
    assert rows(page, "workers", "worker") == {w["worker"]: worker_cells(w) for w in workers}
    # the tiers, top down: each one's share of all prompt tokens, and its own figures
    assert not js(page, "document.getElementById('tiers-card').hidden")
    assert rows(page, "tiers", "tier") == {t["tier"]: tier_cells(t) for t in SECOND["tiers"]}
    # a member in quarantine shows, with who reported it, when (UTC) and why
    assert not js(page, "document.getElementById('quarantine-card').hidden")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(T0))
    assert rows(page, "quarantine", "holder") == {
        "<i>w9</i>": {
            "name": "<i>w9</i>",
            "reporter": "w0",
            "since": since,
            "evidence": "page 3: 0.81",
        }
    }
    # names that look like markup are text: no element of theirs reached the page
    assert (
        js(page, "document.querySelectorAll('#tenants b, #workers i, #quarantine i').length") == 0
    )
    ticks = js(
        page,
        "Array.from(document.querySelectorAll('#chart-workers .xtick text'))"
        ".map((t) => t.textContent)",
    )
    assert ticks == ["w0", "<i>w1</i>", "7"]
    assert js(page, "document.querySelectorAll('#chart-workers .xtick tspan').length") == 0

    history = SECOND["history"]
    names = [w["worker"] for w in workers]
    steps = intervals(history)
    (by_worker,) = traces(page, "chart-workers")
    assert (by_worker["x"], by_worker["y"]) == (names, [w["hit_rate"] for w in workers])
    pages = traces(page, "chart-pages")
    assert [t["name"] for t in pages] == ["free", "cached", "in use"]
    assert [t["y"] for t in pages] == [
        [w["pages"][state] for w in workers] for state in ("free", "cached", "in_use")
    ]
    evictions = traces(page, "chart-evictions")  # one trace per worker: several of them
    assert [t["x"] for t in evictions] == [["evicted", "expired"]] * 3
    assert [t["y"] for t in evictions] == [[20, 4], [5, 0], [0, 0]]
    ttft_bars, ttft_hit, ttft_miss = traces(page, "chart-ttft")
    assert ttft_bars["x"] == ["with reuse", "no reuse"]
    assert ttft_bars["y"] == [5.4 / 36, 29.5 / 25]
    for trace, key in ((ttft_hit, "ttft_hit"), (ttft_miss, "ttft_miss")):
        assert trace["y"] == [mean_increase(a[key], b[key]) for a, b in pairs(history)]
    per_interval, cumulative = traces(page, "chart-hit-rate")
    assert per_interval["y"] == [s["rate"] for s in steps]
    assert cumulative["y"] == [cumulative_rate(p) for p in history]
    assert len(per_interval["x"]) == 4 and len(cumulative["x"]) == 5
    by_source = traces(page, "chart-tokens")
    assert [t["name"] for t in by_source] == ["local hit", "remote hit", "computed"]
    assert [t["y"] for t in by_source] == [
        [s[key] / s["dt"] for s in steps] for key in ("local", "remote", "computed")
    ]

    console = page.get_log("browser")
    assert not [e for e in console if e["level"] == "SEVERE"], console
    path = save_screenshot(page, "dashboard-unit.png")
    assert path.stat().st_size > 10_000


@pytest.mark.slow
def test_a_single_worker_has_its_evictions_in_one_trace(ports, page):
    server = ports.open
    ports.feed.state = FIRST | {"workers": FIRST["workers"][:1]}
    page.get(f"{server.url}/dashboard?interval=0.1")
    wait_for_updates(page, 1)
    (evictions,) = traces(page, "chart-evictions")
    assert (evictions["x"], evictions["y"]) == (["evicted"], [15])


@pytest.mark.slow
def test_a_failed_fetch_shows_a_banner_and_keeps_the_figures(ports, page):
    server, feed = ports.open, ports.feed
    page.get(f"{server.url}/dashboard?interval=0.1")
    wait_for_updates(page, 1)
    feed.state = RuntimeError("the snapshot is gone")
    error = "document.getElementById('error')"
    banner = wait_for_js(page, f"!{error}.hidden && {error}.textContent")
    assert "the snapshot is gone" in banner and "showing the figures of" in banner
    assert js(page, "document.getElementById('requests').textContent") == "38"
    updates = js(page, "window.kvmeshDashboard.updates")
    feed.state = SECOND
    wait_for_js(page, f"window.kvmeshDashboard.updates > {updates}")
    assert js(page, "document.getElementById('error').hidden")
    assert js(page, "document.getElementById('requests').textContent") == "59"


@pytest.mark.slow
def test_without_a_dashboard_the_page_says_it_has_no_data(ports, page):
    server = ports.bare
    page.get(f"{server.url}/dashboard")
    banner = wait_for_js(page, "document.getElementById('error').textContent")
    assert banner.startswith("no data")
    assert js(page, "document.getElementById('updated').textContent") == "no data yet"
    assert js(page, "document.getElementById('requests').textContent") == "–"


@pytest.mark.slow
def test_the_page_loads_plotly_from_its_own_port(ports, page):
    server = ports.open
    page.get(f"{server.url}/dashboard")
    wait_for_updates(page, 1)
    assert js(page, "typeof window.Plotly === 'object' && typeof window.Plotly.react")
    loaded = resource_urls(page)
    assert f"{server.url}/static/plotly.min.js" in loaded, loaded
    assert all(url.startswith(server.url + "/") for url in loaded), loaded
    console = console_log(page)
    assert "Content Security Policy" not in console, console


# ---- the browser harness -----------------------------------------------------------------


@pytest.mark.slow
def test_a_wait_that_times_out_names_the_expression_and_shows_the_console(ports, page):
    page.get(f"{ports.bare.url}/dashboard")
    page.execute_script("console.error('the page says why')")
    with pytest.raises(AssertionError, match="the page says why") as failed:
        wait_for_js(page, "window.neverSet === 1", timeout_s=0.2)
    assert "`window.neverSet === 1` is still False" in str(failed.value)


def test_without_chromium_the_harness_names_the_packages_to_install(monkeypatch):
    monkeypatch.setattr(harness, "CHROMIUM", Path("/nonexistent/chromium"))
    with (
        pytest.raises(RuntimeError, match="apt-get install chromium chromium-driver"),
        open_browser(),
    ):
        pass
