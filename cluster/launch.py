"""`kvmesh up` / `kvmesh down`: a mesh that outlives the command that started it.

`up` starts the service and the workers as detached Ray actors (and their placement
group detached too), so they keep running after the command returns. With no address it
first starts a Ray head of its own on this machine, as a process of its own
(`ray start --head --block` in a new session), which outlives the command as well.

`down` stops what `up` started and nothing else: the mesh's actors and placement group,
found by name in the Ray cluster, and the Ray head only when `up` started it, by the
process id `up` recorded (never by looking for processes by name). SIGTERM to that
process makes Ray stop every process of the head (its reaper does so even if it dies).

What `up` started is recorded in `$KVMESH_STATE_DIR/mesh.json` (default `~/.kvmesh`):
the Ray address, the head's process id and log. `status`, `top` and `down` read it when
no address is given. Beside it, `enroll.key` (mode 0600) holds the key of the mesh's
enrollment tokens: `up` prints one token, `kvmesh enroll-token` issues more from it (a
vLLM engine joins with one, see `workers.engines.enrollment`). `up` and `down` hold a
lock on that directory, so two of them never run at once on one machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cache_service import enroll_tokens
from cache_service.actor import RAY_NAMESPACE
from cluster.actors import find_service
from cluster.config import KvmeshConfig, load_config
from cluster.errors import LaunchError
from cluster.mesh import Mesh
from cluster.placement import live_nodes

RECORD_NAME = "mesh.json"
ENROLL_KEY_NAME = "enroll.key"  # the key of the mesh's enrollment tokens, mode 0600
RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch for its own token authentication
HEAD_START_TIMEOUT_S = 90.0
HEAD_STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LaunchRecord:
    """What `kvmesh up` started on this machine."""

    address: str  # the Ray cluster's GCS address
    config: str  # the configuration file it was started with
    started_at: float
    head_pid: int | None = None  # the `ray start --head --block` process, if `up` started it
    head_log: str | None = None
    ray_temp_dir: str | None = None
    # Ray's own authentication of that cluster (RAY_AUTH_MODE) as `up` started it:
    # "token" for a head of kvmesh's own; None (the environment decides) otherwise.
    ray_auth_mode: str | None = None


def state_dir() -> Path:
    """Where `up` records what it started ($KVMESH_STATE_DIR, default ~/.kvmesh)."""
    return Path(os.environ.get("KVMESH_STATE_DIR") or Path.home() / ".kvmesh")


def read_record() -> LaunchRecord | None:
    path = state_dir() / RECORD_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path} cannot be read ({exc}); remove it if no mesh is up") from exc
    return LaunchRecord(**data)


def _write_record(record: LaunchRecord) -> None:
    path = state_dir() / RECORD_NAME
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(dataclasses.asdict(record), indent=2) + "\n")
    scratch.replace(path)


def _clear_record() -> None:
    for name in (RECORD_NAME, ENROLL_KEY_NAME):
        with contextlib.suppress(FileNotFoundError):
            (state_dir() / name).unlink()


def _write_enroll_key(key: bytes) -> None:
    """Keep the enrollment key where only this user reads it (created 0600, never wider)."""
    path = state_dir() / ENROLL_KEY_NAME
    scratch = path.with_suffix(".tmp")
    with contextlib.suppress(FileNotFoundError):
        scratch.unlink()
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key.hex() + "\n")
    scratch.replace(path)


def enrollment_tokens(count: int = 1, engines: int = 1) -> list[str]:
    """`count` new enrollment tokens of the mesh `up` started on this machine, each for
    `engines` engines (a deployment's replicas share one).

    Raises:
        LaunchError: no mesh is up here (no key), or `count` or `engines` out of range.
    """
    if count < 1:
        raise LaunchError(f"count must be at least 1, got {count}")
    if not 1 <= engines <= enroll_tokens.MAX_ENGINES:
        raise LaunchError(f"engines must be 1 to {enroll_tokens.MAX_ENGINES}, got {engines}")
    path = state_dir() / ENROLL_KEY_NAME
    try:
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        raise LaunchError(
            f"no enrollment key in {state_dir()}: tokens are issued where `kvmesh up` ran"
        ) from None
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path} cannot be read ({exc})") from exc
    return [enroll_tokens.issue(key, engines) for _ in range(count)]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold this machine's launch lock (one `up` or `down` at a time)."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(
                f"another `kvmesh up` or `kvmesh down` is running (lock {directory / 'lock'})"
            ) from None
        yield


def up(
    config: str | Path,
    address: str | None = None,
    log=sys.stderr,
    min_nodes: int = 1,
    nodes_timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Start a mesh that keeps running after this call returns.

    Args:
        config: the YAML configuration.
        address: a running Ray cluster to start it in ("auto": the one on this machine);
            None starts a Ray head of its own on this machine.
        log: where progress goes.
        min_nodes: wait until the cluster has this many live nodes before placing the
            workers (a `ray up` head starts before its worker nodes have joined).
        nodes_timeout_s: how long to wait for them.
    Returns:
        The new mesh's status (`Mesh.stats()`).
    Raises:
        LaunchError: a mesh is already up (here or in that cluster), or the head did not
            start.
        ConfigError, PlacementError: the configuration cannot be used or placed; nothing
            is left behind.
    """
    cfg = load_config(config)
    if min_nodes < 1:
        raise LaunchError(f"min_nodes must be at least 1, got {min_nodes}")
    with _locked():
        record = read_record()
        if record is not None:
            if record.head_pid is None or _is_our_head(record.head_pid):
                raise LaunchError(
                    f"kvmesh is already up: Ray at {record.address}, started "
                    f"{_when(record.started_at)} with {record.config}; run `kvmesh down` "
                    "first"
                )
            print(
                f"the Ray head of an earlier `kvmesh up` (pid {record.head_pid}) is gone; "
                "starting afresh",
                file=log,
            )
            _clear_record()
        head = _start_head(log) if address is None else None
        try:
            where = address or head.address
            return _up_in(
                cfg, str(Path(config).resolve()), where, head, log, min_nodes, nodes_timeout_s
            )
        except BaseException:
            if head is not None:
                _stop_head(head.head_pid, log)
            raise


def _up_in(
    cfg: KvmeshConfig,
    config: str,
    address: str,
    head: LaunchRecord | None,
    log,
    min_nodes: int,
    nodes_timeout_s: float,
) -> dict[str, Any]:
    _join(address, head.ray_auth_mode if head else None)
    try:
        if find_service() is not None:
            raise LaunchError(
                f"a kvmesh mesh already runs in the Ray cluster at {address}; "
                f"`kvmesh down --address {address}` stops it"
            )
        _wait_for_nodes(min_nodes, nodes_timeout_s, log)
        mesh = Mesh._start(cfg, started_ray=False, detached=True, log=log)
        record = LaunchRecord(
            address=ray.get_runtime_context().gcs_address,
            config=config,
            started_at=time.time(),
            head_pid=head.head_pid if head else None,
            head_log=head.head_log if head else None,
            ray_temp_dir=head.ray_temp_dir if head else None,
            ray_auth_mode=head.ray_auth_mode if head else None,
        )
        _write_record(record)
        _write_enroll_key(mesh.enroll_key)
        status = mesh.stats()
        mesh.detach()
        return status
    finally:
        ray.shutdown()


def _wait_for_nodes(count: int, timeout_s: float, log) -> None:
    start = time.monotonic()
    while (alive := len(live_nodes())) < count:
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise LaunchError(
                f"the Ray cluster has {alive} live node(s) after {waited:.0f}s; "
                f"--min-nodes asked for {count}"
            )
        print(f"waiting for Ray nodes: {alive}/{count} ({waited:.0f}s)", file=log)
        time.sleep(5.0)


def down(address: str | None = None, log=sys.stderr) -> bool:
    """Stop the mesh `up` started (or the one at `address`), and the Ray head if `up`
    started it.

    Returns:
        Whether anything was stopped.
    """
    with _locked():
        record = read_record()
        target = address or (record.address if record else None)
        if target is None:
            print(f"nothing to stop: no `kvmesh up` is recorded in {state_dir()}", file=log)
            return False
        stopped = False
        ours = record is not None and target == record.address
        head_pid = record.head_pid if ours else None
        head_alive = head_pid is not None and _is_our_head(head_pid)
        if head_pid is None or head_alive:
            stopped = _stop_mesh(target, record.ray_auth_mode if ours else None, log)
        if head_alive:
            _stop_head(head_pid, log)
            stopped = True
        elif head_pid is not None:
            print(f"the Ray head `kvmesh up` started (pid {head_pid}) is gone already", file=log)
        if ours:
            _clear_record()
        from workers.store.segment_names import reclaim_dead_segments

        reclaim_dead_segments()
        return stopped


def _stop_mesh(address: str, auth_mode: str | None, log) -> bool:
    try:
        _join(address, auth_mode)
    except (ConnectionError, RuntimeError) as exc:
        print(f"Ray at {address} cannot be reached ({exc}); nothing stopped there", file=log)
        return False
    try:
        service = find_service()
        if service is None:
            print(f"no kvmesh mesh runs in the Ray cluster at {address}", file=log)
            return False
        mesh = Mesh._attach(service, started_ray=False, cfg=None, log=log, partial=True)
        print(f"stopping {len(mesh.workers)} workers and the service...", file=log)
        mesh.stop()
        return True
    finally:
        ray.shutdown()


@contextlib.contextmanager
def attached(address: str | None = None) -> Iterator[Mesh]:
    """A front door to the running mesh (for `status` and `top`), detached on exit.

    Raises:
        LaunchError: no address given and none recorded, or no mesh runs there.
    """
    record = read_record()
    if address is None:
        if record is None:
            raise LaunchError(
                f"no `kvmesh up` is recorded in {state_dir()}: pass --address of the Ray "
                "cluster the mesh runs in"
            )
        address = record.address
    _join(address, record.ray_auth_mode if record and record.address == address else None)
    try:
        service = find_service()
        if service is None:
            raise LaunchError(f"no kvmesh mesh runs in the Ray cluster at {address}")
        mesh = Mesh._attach(service, started_ray=False, cfg=None, log=io.StringIO())
        try:
            yield mesh
        finally:
            mesh.detach()
    finally:
        ray.shutdown()


def _join(address: str, auth_mode: str | None) -> None:
    """Connect to the Ray cluster at `address`. Ray authenticates drivers that join by an
    explicit address only when RAY_AUTH_MODE says so; a head that `up` started uses
    Ray's token authentication, so joining it sets the mode (unless the environment
    already does)."""
    if auth_mode == "token" and RAY_AUTH_MODE not in os.environ:
        # What ray.init does for a local cluster it finds itself ("auto"), and only then:
        # switch this process to token mode when a token is at hand.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        # Its warning ("enabled ... set RAY_AUTH_MODE=disabled to opt out") is about a
        # choice kvmesh made when it started the head; not news to the operator.
        setup_log = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
        level = setup_log.level
        setup_log.setLevel(logging.ERROR)
        try:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        finally:
            setup_log.setLevel(level)
    ray.init(
        address=address,
        namespace=RAY_NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


# ---------------------------------------------------------------------- the Ray head


def _start_head(log) -> LaunchRecord:
    """Start a Ray head on this machine, in a process (and session) of its own."""
    directory = state_dir()
    # Short and fresh: Ray's socket paths live under it, and must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="kvmesh-ray-")
    head_log = directory / "ray-head.log"
    command = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--port=0",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--block",
    ]
    # Ray's token authentication on, as Ray itself defaults a new head to, unless the
    # environment chose otherwise; `_join` then presents the token (~/.ray/auth_token).
    auth_mode = os.environ.get(RAY_AUTH_MODE, "token")
    print(f"starting a Ray head on this machine (log: {head_log})...", file=log)
    with open(head_log, "w") as out:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, RAY_AUTH_MODE: auth_mode},
        )  # fmt: skip
    address_file = Path(temp_dir) / "ray_current_cluster"
    start = time.monotonic()
    while not address_file.exists() or not address_file.read_text().strip():
        if process.poll() is not None:
            raise LaunchError(
                f"the Ray head exited with status {process.returncode}:\n{_tail(head_log)}"
            )
        if time.monotonic() - start > HEAD_START_TIMEOUT_S:
            _stop_head(process.pid, log)
            raise LaunchError(
                f"the Ray head did not start within {HEAD_START_TIMEOUT_S:g}s:\n{_tail(head_log)}"
            )
        time.sleep(0.2)
    address = address_file.read_text().strip()
    print(f"Ray head at {address} ({time.monotonic() - start:.0f}s)", file=log)
    return LaunchRecord(
        address=address,
        config="",
        started_at=time.time(),
        head_pid=process.pid,
        head_log=str(head_log),
        ray_temp_dir=temp_dir,
        ray_auth_mode=auth_mode,
    )


def _is_our_head(pid: int) -> bool:
    """Whether `pid` is still a `ray start --head` process (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"ray.scripts.scripts" in cmdline and b"start" in cmdline and b"--head" in cmdline


def _stop_head(pid: int, log) -> None:
    """SIGTERM the head's `ray start --block` process: it stops the head's processes and
    exits. Wait for that, with progress; SIGKILL it if it hangs (its reaper then stops
    the rest)."""
    print(f"stopping the Ray head (pid {pid})...", file=log)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    start = time.monotonic()
    while _is_our_head(pid):
        _reap(pid)
        waited = time.monotonic() - start
        if waited > HEAD_STOP_TIMEOUT_S:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            print(f"the Ray head did not stop in {waited:.0f}s; killed", file=log)
            break
        time.sleep(0.2)
    _reap(pid)


def _reap(pid: int) -> None:
    """Collect the head's exit status when it is this process's child (the `up` that
    started it is cleaning up after a failure); otherwise its zombie is init's."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
