"""Page store segments' names, and reclaiming the segments of owners that have died.

Segments are named `kvmesh-{pid}-{start_time}-{tag}` after their owner, so the segments
of a killed worker can be found and reclaimed (`reclaim_dead_segments`). The start time
(field 22 of /proc/{pid}/stat) tells a dead owner from a new process that reuses its pid.
"""

from __future__ import annotations

import os
import re
import secrets

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvmesh-"

_TAG_RE = re.compile(r"[a-z0-9_]{1,32}")
_NAME_RE = re.compile(r"kvmesh-(\d+)-(\d+)-([a-z0-9_]{1,32})")


def process_start_time(pid: int) -> int | None:
    """Start time of a running process (clock ticks since boot), or None if none runs.

    Args:
        pid: the process id.

    Returns:
        Field 22 of /proc/{pid}/stat, or None when no process has that pid or it is a
        zombie (its segments are then as good as an exited owner's).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (the command name) may itself contain spaces and parentheses; fields after
    # the last ')' are plain, starting with field 3, the state.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":  # killed, not yet reaped by its parent: it runs no more
        return None
    return int(fields[22 - 3])


def worker_tag(worker_id: str) -> str:
    """A segment tag naming a worker: its id in [a-z0-9_], at most 32 characters."""
    return re.sub(r"[^a-z0-9_]", "_", worker_id.lower())[:32] or "worker"


def segment_name(tag: str | None) -> str:
    """The name of a segment this process would own: `kvmesh-{pid}-{start_time}-{tag}`.

    Args:
        tag: a suffix matching [a-z0-9_]{1,32}; a random one when None.

    Raises:
        ValueError: a bad tag.
    """
    if tag is None:
        tag = secrets.token_hex(4)
    elif not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise ValueError(f"tag must match [a-z0-9_]{{1,32}}, got {tag!r}")
    pid = os.getpid()
    return f"{SEGMENT_PREFIX}{pid}-{process_start_time(pid)}-{tag}"


def segment_path(name: str) -> str:
    """The path of segment `name` under /dev/shm.

    Raises:
        ValueError: `name` is not a kvmesh segment name.
    """
    # Names become paths under /dev/shm: only ever accept exactly our own format.
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"not a kvmesh segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def owner_alive(name: str) -> bool:
    """Whether the process that created segment `name` still runs (on this node: pids are
    this node's). A name not in the kvmesh format has no owner we know of: False."""
    match = _NAME_RE.fullmatch(name)
    return match is not None and process_start_time(int(match[1])) == int(match[2])


def reclaim_dead_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink the segments of owners that no longer run.

    A segment is reclaimed when no process has its owner's pid, or the process with that
    pid started at another time (the pid was reused). Segments of live owners and files
    whose names are not in the kvmesh format are never touched.

    Owners are looked up in this process's /proc, so every process sharing /dev/shm must
    share one pid namespace (the norm: a container has its own /dev/shm).

    Args:
        prefix: only names starting with this are considered (e.g. "kvmesh-1234-" for
            the segments of one pid).

    Returns:
        The names unlinked, sorted.
    """
    reclaimed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix) or not _NAME_RE.fullmatch(name) or owner_alive(name):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except (FileNotFoundError, PermissionError):
            # Another process reclaimed it first, or it is another user's: not ours to take.
            continue
        reclaimed.append(name)
    return reclaimed
