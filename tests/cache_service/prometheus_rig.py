"""A real Prometheus scraping one kvmesh target, for tests of what the dashboard reads.

    with PrometheusRig(server.metrics_url, token=metrics_token) as prometheus:
        prometheus.wait_for_samples("kvmesh_workers_live")
        ...                                   # run the workload
        prometheus.wait_for_scrape()          # a scrape that began after the workload ended
        hit_rate = prometheus.value(expr)

The rig runs Debian's `prometheus` binary as a child process of the test, on loopback, with
its storage in a temporary directory; leaving the `with` block stops the process and
removes the directory; should the test process die without leaving it, the kernel stops
Prometheus too (the parent-death signal, which follows the thread that started the rig: start
it from the thread that lives as long as it should). Only the standard library speaks HTTP.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PROMETHEUS = "/usr/bin/prometheus"
DEBIAN_PACKAGE = "prometheus"
JOB = "kvmesh"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0  # SIGTERM lets it close the TSDB cleanly; past this it gets SIGKILL
HTTP_TIMEOUT_S = 5.0
POLL_S = 0.1
LOG_TAIL_LINES = 20
START_ATTEMPTS = 3  # a free port can be taken between our probe and Prometheus's bind


class PrometheusError(RuntimeError):
    """Prometheus did not start, stopped, or did not scrape what a test waited for."""


class QueryError(PrometheusError):
    """Prometheus refused a query (its own error text is in the message)."""


class PrometheusRig:
    """A Prometheus process scraping `target_url` every `scrape_interval_s`, as a context
    manager.

    Args:
        target_url: the scrape target, e.g. "http://127.0.0.1:40125/metrics" (a service's
            `metrics_url`); its path is the metrics path ("/metrics" when it has none).
        token: sent as `Authorization: Bearer <token>` with every scrape ("" sends none).
        scrape_interval_s: how often the target is scraped.
        binary: the Prometheus executable.
        ready_timeout_s: how long Prometheus may take to answer /-/ready.
        stop_timeout_s: how long it may take to exit after SIGTERM before it is killed.
    Raises:
        ValueError: a target URL that is not http(s)://host:port/path, or an interval <= 0.
        PrometheusError (on entering): no binary, or Prometheus exited or was not ready in
            time (the message carries the tail of its log).
    """

    def __init__(
        self,
        target_url: str,
        token: str = "",
        scrape_interval_s: float = 1.0,
        *,
        binary: str = PROMETHEUS,
        ready_timeout_s: float = READY_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.scheme, self.target, self.metrics_path = _split_target(target_url)
        if not scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s must be > 0, got {scrape_interval_s}")
        self.target_url = target_url
        self.token = token
        self.scrape_interval_s = scrape_interval_s
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.workdir: Path | None = None  # kept after exit, so a test can look for leftovers
        self.url = ""  # e.g. "http://127.0.0.1:40200", once started
        self._process: subprocess.Popen | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> PrometheusRig:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Write the config, start Prometheus and wait until it is ready."""
        if not os.access(self.binary, os.X_OK):
            raise PrometheusError(
                f"no Prometheus at {self.binary}: install Debian's '{DEBIAN_PACKAGE}' package "
                f"(apt-get install -y {DEBIAN_PACKAGE}); the rig runs that binary itself, "
                "never the system service"
            )
        if self._process is not None:
            raise RuntimeError("this rig is already running")
        self.workdir = Path(tempfile.mkdtemp(prefix="kvmesh-prometheus-"))
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                port = _free_port()
                self._spawn(config, port)
                try:
                    self._wait_ready()
                    return
                except PrometheusError:
                    port_taken = "address already in use" in self.log_tail()
                    self._terminate()
                    if not port_taken or attempt == START_ATTEMPTS:
                        raise
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, SIGKILL after `stop_timeout_s`), remove its directory."""
        self._terminate()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def config(self) -> dict[str, Any]:
        """The prometheus.yml this rig writes, as a dict."""
        interval = _duration(self.scrape_interval_s)
        job: dict[str, Any] = {
            "job_name": JOB,
            "scheme": self.scheme,
            "metrics_path": self.metrics_path,
            # Prometheus refuses a timeout longer than the interval; the global one is 1 s.
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "static_configs": [{"targets": [self.target]}],
        }
        if self.token:
            job["authorization"] = {"type": "Bearer", "credentials": self.token}
        return {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "scrape_configs": [job],
        }

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines Prometheus wrote to its log ("" once the rig is gone)."""
        if self.workdir is None:
            return ""
        try:
            text = (self.workdir / "prometheus.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _spawn(self, config: Path, port: int) -> None:
        assert self.workdir is not None
        self.url = f"http://127.0.0.1:{port}"
        args = [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",  # loopback only: no one else scrapes us
            "--storage.tsdb.retention.time=1h",
        ]
        # Other tests share this machine; Go would otherwise run a thread per core.
        env = {**os.environ, "GOMAXPROCS": "2"}
        with open(self.workdir / "prometheus.log", "ab") as log:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise PrometheusError(
                    f"Prometheus exited with status {code} before it was ready; its log "
                    f"ends:\n{self.log_tail()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"Prometheus was not ready at {self.url} after {self.ready_timeout_s} s; "
                    f"its log ends:\n{self.log_tail()}"
                )
            time.sleep(POLL_S)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as reply:
                return reply.status == 200
        except OSError:  # refused, 503 while it replays its storage, or a timeout
            return False

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # -- queries --------------------------------------------------------------------------

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant-query result of `expr` now, one {"metric": labels, "value": [time,
        "text"]} per series (a scalar or string result is one series with no labels).

        Raises:
            QueryError: Prometheus refused `expr` (bad PromQL, say), with its error text.
        """
        data = self._api("query", {"query": expr}, what=f"query {expr!r}")
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] != "vector":
            raise QueryError(f"query {expr!r} gave a {data['resultType']}, not an instant vector")
        return data["result"]

    def values(self, expr: str) -> dict[frozenset[tuple[str, str]], float]:
        """{labels: value} of `expr` now."""
        return {
            frozenset(series["metric"].items()): float(series["value"][1])
            for series in self.query(expr)
        }

    def value(self, expr: str) -> float:
        """The one value of `expr` now.

        Raises:
            QueryError: `expr` gave no series or more than one.
        """
        result = self.query(expr)
        if len(result) != 1:
            labels = [series["metric"] for series in result]
            raise QueryError(f"query {expr!r} gave {len(result)} series, not one: {labels}")
        return float(result[0]["value"][1])

    def wait_for_samples(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll `expr` until it gives at least one series; returns that result.

        Raises:
            QueryError: Prometheus refused `expr` (at once: waiting would not help).
            PrometheusError: no series after `timeout_s`; the message says how the target's
                scrapes went.
        """
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(expr)):
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"no samples of {expr!r} after {timeout_s} s; {self._target_health()}"
                )
            time.sleep(POLL_S)
        return result

    def wait_for_scrape(self, since: float | None = None, timeout_s: float = 10.0) -> float:
        """Wait for a successful scrape that began after `since` (time.time(); default now),
        so what queries see next was read from the target after that moment.

        Returns:
            The time of that scrape (seconds since the epoch, to the millisecond).
        Raises:
            PrometheusError: no such scrape within `timeout_s`, with the target's health.
        """
        since = time.time() if since is None else since
        deadline = time.monotonic() + timeout_s
        selector = f'up{{job="{JOB}"}}'
        while True:
            # A scrape's samples and its `up` are committed together, under the scrape's
            # start time: a fresh `up` = 1 means the samples of that scrape are queryable.
            up = self.query(selector)
            stamps = self.query(f"timestamp({selector})")
            if up and stamps and float(up[0]["value"][1]) == 1:
                stamp = float(stamps[0]["value"][1])
                if stamp > since:
                    return stamp
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"no successful scrape since {since:.3f} within {timeout_s} s; "
                    f"{self._target_health()}"
                )
            time.sleep(POLL_S)

    def targets(self) -> list[dict[str, Any]]:
        """The active targets as /api/v1/targets reports them (scrapeUrl, health, lastError,
        lastScrape, labels, ...)."""
        return self._api("targets", {"state": "active"}, what="targets")["activeTargets"]

    def _target_health(self) -> str:
        reports = [
            f"{t['scrapeUrl']} is {t['health']} (last scrape {t['lastScrape']}, "
            f"error {t['lastError']!r})"
            for t in self.targets()
        ]
        return "target " + "; ".join(reports) if reports else "Prometheus has no targets"

    def _api(self, path: str, params: dict[str, str], what: str) -> Any:
        if not self.url:
            raise PrometheusError("the rig is not running: use it inside its `with` block")
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as error:
            # Prometheus answers a bad query with 400 (or 422) and its reason as JSON.
            text = error.read().decode(errors="replace")
            try:
                reason = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                reason = text.strip()
            raise QueryError(f"Prometheus refused {what} ({error.code}): {reason}") from None
        except OSError as error:
            raise PrometheusError(
                f"Prometheus at {self.url} did not answer {what}: {error}; its log ends:\n"
                f"{self.log_tail()}"
            ) from error
        if body.get("status") != "success":
            raise QueryError(f"Prometheus refused {what}: {body.get('error', body)}")
        return body["data"]


def _split_target(url: str) -> tuple[str, str, str]:
    """(scheme, "host:port", metrics path) of a scrape target URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"a scrape target must be http(s)://host:port/path, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"a scrape target takes no query or fragment, got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return parts.scheme, f"{host}:{parts.port}", parts.path or "/metrics"


def _duration(seconds: float) -> str:
    """A Prometheus duration: "1s", "250ms"."""
    ms = max(1, math.ceil(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# prctl(PR_SET_PDEATHSIG, SIGTERM) in the child: should the test process die without
# running its `with` exits (killed on a timeout, say), the kernel stops Prometheus too.
# Looked up here, in the parent, so the child between fork and exec only makes the call.
_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the `with` block is the only cleanup
    _prctl = None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
