// kvmesh's live hit-rate dashboard: polls api/dashboard and draws what it says.
//
// api/dashboard (cache_service/web.py) answers one JSON object:
//   now, epoch, workers_live
//   totals     {requests, local_hit, remote_hit, computed, hit_rate}
//   history    [{t, requests, local_hit, remote_hit, computed, ttft_hit: {count, sum},
//                ttft_miss: {count, sum}, evictions}]   oldest first, cumulative counters
//   workers    [{worker, live, requests, local_hit, remote_hit, computed, hit_rate,
//                pages: {free, cached, in_use}, evictions: {reason: pages}}]
//   tenants    [{tenant, requests, local_hit, remote_hit, computed, hit_rate}]
//   evictions  {reason: pages}                         over all workers
//   ttft       {hit: {count, sum, buckets}, miss: {count, sum, buckets}}
//   quarantined [{holder, reporter, since, evidence}]   members in quarantine
//   tiers      [{tier, hit_tokens, hit_rate, pages, capacity, evictions: {reason: pages},
//                workers, accepting, bytes_written, bytes_read, demotions, errors,
//                dropped: {reason: records}}]  top down; hit_rate is the share of all
//                prompt tokens; figures no worker reported for a tier are null
//
// Figures per interval come from consecutive history points a, b: rates are
// (b.x - a.x) / (b.t - a.t). A counter that went down was reset (a restarted worker), so
// the difference counts as b.x, as Prometheus's rate() counts it.
//
// Tenant and worker names are chosen by users: they reach the DOM through textContent and
// attributes only, and reach plotly (which reads <b>, <a> and friends in its labels) as
// entities.

"use strict";

(() => {
  const state = { last: null, updates: 0 };
  window.kvmeshDashboard = state; // for tests: the last object drawn, and how many

  const PLOT_CONFIG = { displayModeBar: false, responsive: true };
  const COLORS = {
    local: "#2f6fdf", remote: "#21a67a", computed: "#c9ccd1",
    free: "#c9ccd1", cached: "#2f6fdf", in_use: "#f0a030",
    hit: "#21a67a", miss: "#d9534f", down: "#9aa3ad",
  };
  const NO_DATA = "–";

  const pollSeconds = readInterval();
  forgetTokenInAddress();
  poll();

  async function poll() {
    try {
      const data = await fetchDashboard();
      draw(data);
      state.last = data;
      state.updates += 1;
      const updated = document.getElementById("updated");
      updated.textContent = `updated ${clock(Date.now() / 1000)}`;
      updated.dataset.updates = String(state.updates);
      hideError();
    } catch (error) {
      showError(error);
    }
    setTimeout(poll, pollSeconds * 1000);
  }

  async function fetchDashboard() {
    const reply = await fetch("api/dashboard", {
      cache: "no-store",
      credentials: "same-origin",
      headers: { Accept: "application/json" },
    });
    if (reply.status === 404) {
      throw new Error("no data: this service publishes no dashboard data");
    }
    if (reply.status === 401) {
      throw new Error("not admitted: open this page as /dashboard?token=<the access token>");
    }
    if (!reply.ok) {
      throw new Error(`api/dashboard answered ${reply.status}: ${(await reply.text()).trim()}`);
    }
    return reply.json();
  }

  function draw(data) {
    const totals = data.totals || {};
    const workers = data.workers || [];
    const tenants = data.tenants || [];
    setText("requests", integer(totals.requests));
    setText("hit-rate", percent(totals.hit_rate));
    setText("local-hit-tokens", integer(totals.local_hit));
    setText("remote-hit-tokens", integer(totals.remote_hit));
    setText("computed-tokens", integer(totals.computed));
    setText("workers-live", integer(data.workers_live));
    setText("epoch", integer(data.epoch));
    fillTable("workers", workers, "worker", workerCells);
    fillTable("tenants", tenants, "tenant", tokenCells);
    const quarantined = data.quarantined || [];
    document.getElementById("quarantine-card").hidden = quarantined.length === 0;
    fillTable("quarantine", quarantined, "holder", quarantineCells);
    const tiers = data.tiers || []; // none from a service before tiers
    document.getElementById("tiers-card").hidden = tiers.length === 0;
    fillTable("tiers", tiers, "tier", tierCells);
    if (!window.Plotly) {
      throw new Error("plotly.js did not load (static/plotly.min.js): the charts are missing");
    }
    const history = data.history || [];
    const steps = intervals(history);
    drawHitRate(history, steps);
    drawTokens(steps);
    drawTtft(data.ttft || {}, steps);
    drawWorkers(workers);
    drawPages(workers);
    drawEvictions(data.evictions || {}, workers);
  }

  // ---- figures per interval -------------------------------------------------------

  function intervals(history) {
    const steps = [];
    for (let i = 1; i < history.length; i++) {
      const a = history[i - 1];
      const b = history[i];
      const dt = b.t - a.t;
      if (!(dt > 0)) continue; // a repeated or misordered point says nothing per second
      const local = increase(a.local_hit, b.local_hit);
      const remote = increase(a.remote_hit, b.remote_hit);
      const computed = increase(a.computed, b.computed);
      const tokens = local + remote + computed;
      steps.push({
        t: b.t,
        dt,
        local,
        remote,
        computed,
        hitRate: tokens > 0 ? (local + remote) / tokens : null,
        ttftHit: meanIncrease(a.ttft_hit, b.ttft_hit),
        ttftMiss: meanIncrease(a.ttft_miss, b.ttft_miss),
      });
    }
    return steps;
  }

  function increase(before, after) {
    const difference = after - before;
    return difference < 0 ? after : difference;
  }

  function meanIncrease(before, after) {
    if (!before || !after) return null;
    const reset = after.count < before.count;
    const count = reset ? after.count : after.count - before.count;
    const sum = reset ? after.sum : after.sum - before.sum;
    return count > 0 ? sum / count : null;
  }

  function cumulativeHitRate(point) {
    const tokens = point.local_hit + point.remote_hit + point.computed;
    return tokens > 0 ? (point.local_hit + point.remote_hit) / tokens : null;
  }

  function mean(summary) {
    return summary && summary.count > 0 ? summary.sum / summary.count : null;
  }

  // ---- charts ---------------------------------------------------------------------

  function drawHitRate(history, steps) {
    const traces = [
      {
        // markers too: an interval between two idle ones has no line to draw
        name: "per interval", type: "scatter", mode: "lines+markers",
        x: steps.map((s) => clock(s.t)), y: steps.map((s) => s.hitRate),
        line: { color: COLORS.local }, marker: { size: 4 },
      },
      {
        name: "cumulative", type: "scatter", mode: "lines",
        x: history.map((p) => clock(p.t)), y: history.map(cumulativeHitRate),
        line: { color: COLORS.remote, dash: "dot" },
      },
    ];
    plot("chart-hit-rate", traces, {
      xaxis: { type: "date" },
      yaxis: { tickformat: ".0%", range: [0, 1.02], fixedrange: true },
    });
  }

  function drawTokens(steps) {
    const x = steps.map((s) => clock(s.t));
    const source = (name, key, color) => ({
      name, type: "scatter", mode: "lines", stackgroup: "tokens",
      x, y: steps.map((s) => s[key] / s.dt), line: { color, width: 1 },
    });
    plot("chart-tokens", [
      source("local hit", "local", COLORS.local),
      source("remote hit", "remote", COLORS.remote),
      source("computed", "computed", COLORS.computed),
    ], { xaxis: { type: "date" }, yaxis: { title: { text: "tokens/s" } } });
  }

  function drawTtft(ttft, steps) {
    const x = steps.map((s) => clock(s.t));
    const traces = [
      {
        name: "mean", type: "bar", showlegend: false,
        x: ["with reuse", "no reuse"], y: [mean(ttft.hit), mean(ttft.miss)],
        customdata: [ttft.hit?.count ?? 0, ttft.miss?.count ?? 0],
        hovertemplate: "%{x}: %{y:.3f} s over %{customdata} requests<extra></extra>",
        marker: { color: [COLORS.hit, COLORS.miss] },
      },
      {
        name: "with reuse", type: "scatter", mode: "lines", xaxis: "x2", yaxis: "y2",
        x, y: steps.map((s) => s.ttftHit), line: { color: COLORS.hit },
      },
      {
        name: "without reuse", type: "scatter", mode: "lines", xaxis: "x2", yaxis: "y2",
        x, y: steps.map((s) => s.ttftMiss), line: { color: COLORS.miss },
      },
    ];
    plot("chart-ttft", traces, {
      xaxis: { domain: [0, 0.34], type: "category", tickangle: 0, fixedrange: true },
      yaxis: { title: { text: "seconds" }, rangemode: "tozero", fixedrange: true },
      xaxis2: { domain: [0.46, 1], type: "date", anchor: "y2" },
      yaxis2: { anchor: "x2", rangemode: "tozero" },
    });
  }

  function drawWorkers(workers) {
    const names = workers.map((w) => w.worker);
    plot("chart-workers", [
      {
        name: "hit rate", type: "bar", x: names, y: workers.map((w) => w.hit_rate),
        customdata: names.map(plotlyText),
        hovertemplate: "%{customdata}: %{y:.1%}<extra></extra>",
        marker: { color: workers.map((w) => (w.live ? COLORS.local : COLORS.down)) },
      },
    ], {
      xaxis: categories(names),
      yaxis: { tickformat: ".0%", range: [0, 1.02], fixedrange: true },
      showlegend: false,
    });
  }

  function drawPages(workers) {
    const names = workers.map((w) => w.worker);
    const pagesIn = (label, key) => ({
      name: label, type: "bar", x: names, y: workers.map((w) => w.pages?.[key] ?? null),
      customdata: names.map(plotlyText),
      hovertemplate: `%{customdata}: %{y} ${label}<extra></extra>`,
      marker: { color: COLORS[key] },
    });
    plot("chart-pages", [
      pagesIn("free", "free"), pagesIn("cached", "cached"), pagesIn("in use", "in_use"),
    ], { barmode: "stack", xaxis: categories(names), yaxis: { title: { text: "pages" } } });
  }

  function drawEvictions(evictions, workers) {
    const reasons = Object.keys(evictions);
    for (const worker of workers) {
      for (const reason of Object.keys(worker.evictions || {})) {
        if (!reasons.includes(reason)) reasons.push(reason);
      }
    }
    const byReason = (counts) => reasons.map((reason) => counts?.[reason] ?? 0);
    const traces = workers.length > 1
      ? workers.map((w) => ({
        name: plotlyText(w.worker), type: "bar", x: reasons, y: byReason(w.evictions),
      }))
      : [{ name: "pages", type: "bar", x: reasons, y: byReason(evictions), showlegend: false }];
    plot("chart-evictions", traces, {
      barmode: "stack", xaxis: categories(reasons), yaxis: { title: { text: "pages" } },
    });
  }

  function plot(id, traces, layout) {
    const base = {
      margin: { l: 48, r: 8, t: 24, b: 28 },
      font: { size: 11 },
      legend: { orientation: "h", x: 0, y: 1.14 },
      paper_bgcolor: "rgba(0,0,0,0)",
      uirevision: id, // a zoom the reader chose survives the next poll
    };
    window.Plotly.react(id, traces, { ...base, ...layout }, PLOT_CONFIG);
  }

  // A category axis that shows names as written: plotly would read "1" as a number and
  // "<b>x</b>" as bold, so the ticks carry the names as entities.
  function categories(names) {
    return {
      type: "category", tickmode: "array", tickvals: names, ticktext: names.map(plotlyText),
      fixedrange: true,
    };
  }

  function plotlyText(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  // ---- tables ---------------------------------------------------------------------

  function fillTable(id, rows, key, cells) {
    const body = document.querySelector(`#${id} tbody`);
    body.replaceChildren(...rows.map((row) => {
      const tr = document.createElement("tr");
      tr.dataset[key] = String(row[key]);
      if (row.live === false) tr.className = "down";
      for (const [name, text] of [["name", String(row[key])], ...cells(row)]) {
        const td = document.createElement("td");
        td.className = name;
        td.textContent = text;
        tr.append(td);
      }
      return tr;
    }));
  }

  function tokenCells(row) {
    return [
      ["requests", integer(row.requests)],
      ["local-hit", integer(row.local_hit)],
      ["remote-hit", integer(row.remote_hit)],
      ["computed", integer(row.computed)],
      ["hit-rate", percent(row.hit_rate)],
    ];
  }

  function workerCells(row) {
    const pages = row.pages || {};
    return [
      ["live", row.live ? "yes" : "no"],
      ...tokenCells(row),
      ["pages-free", integer(pages.free)],
      ["pages-cached", integer(pages.cached)],
      ["pages-in-use", integer(pages.in_use)],
    ];
  }

  function tierCells(row) {
    return [
      ["pages", integer(row.pages)],
      ["capacity", integer(row.capacity)],
      ["hit-tokens", integer(row.hit_tokens)],
      ["hit-share", percent(row.hit_rate)],
      ["written", byteCount(row.bytes_written)],
      ["read", byteCount(row.bytes_read)],
      ["demotions", integer(row.demotions)],
      ["evictions", integer(total(row.evictions))],
      ["accepting", row.workers > 0 ? `${row.accepting} of ${row.workers}` : NO_DATA],
      ["dropped", integer(total(row.dropped))],
      ["errors", integer(row.errors)],
    ];
  }

  function quarantineCells(row) {
    return [
      ["reporter", String(row.reporter)],
      ["since", new Date(row.since * 1000).toISOString().replace("T", " ").slice(0, 19)],
      ["evidence", String(row.evidence)],
    ];
  }

  // ---- text -----------------------------------------------------------------------

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function integer(value) {
    return Number.isFinite(value) ? Math.round(value).toFixed(0) : NO_DATA;
  }

  // Bytes in binary units, one decimal from KiB up ("512 B", "1.5 MiB").
  function byteCount(value) {
    if (!Number.isFinite(value)) return NO_DATA;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let scaled = value;
    let unit = 0;
    while (scaled >= 1024 && unit < units.length - 1) {
      scaled /= 1024;
      unit += 1;
    }
    return unit === 0 ? `${scaled.toFixed(0)} B` : `${scaled.toFixed(1)} ${units[unit]}`;
  }

  // The sum of a map's counts; null (nothing reported) stays null.
  function total(counts) {
    return counts ? Object.values(counts).reduce((sum, n) => sum + n, 0) : null;
  }

  function percent(rate) {
    return Number.isFinite(rate) ? `${(100 * rate).toFixed(1)}%` : NO_DATA;
  }

  // Local time of unix seconds `t`, as plotly reads dates ("2025-12-01 12:00:00.000").
  function clock(t) {
    const d = new Date(t * 1000);
    const two = (n) => String(n).padStart(2, "0");
    const day = `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())}`;
    const time = `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
    return `${day} ${time}.${String(d.getMilliseconds()).padStart(3, "0")}`;
  }

  function showError(error) {
    const banner = document.getElementById("error");
    const kept = state.updates > 0 ? ` (showing the figures of ${lastUpdate()})` : "";
    banner.textContent = `${error.message || error}${kept}`;
    banner.hidden = false;
  }

  function hideError() {
    const banner = document.getElementById("error");
    banner.hidden = true;
    banner.textContent = "";
  }

  function lastUpdate() {
    return document.getElementById("updated").textContent.replace(/^updated /, "");
  }

  // ---- the page's URL -------------------------------------------------------------

  // ?interval=<seconds> polls at another pace than once a second.
  function readInterval() {
    const seconds = Number(new URLSearchParams(location.search).get("interval"));
    return Number.isFinite(seconds) && seconds > 0 ? Math.max(seconds, 0.05) : 1;
  }

  // The reply to /dashboard?token= stored the token in a cookie: keep it out of the
  // address bar (and out of the history and of screenshots) from here on.
  function forgetTokenInAddress() {
    const url = new URL(location.href);
    if (!url.searchParams.has("token")) return;
    url.searchParams.delete("token");
    history.replaceState(null, "", url);
  }
})();
