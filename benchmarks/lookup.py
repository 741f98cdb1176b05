"""`kvmesh bench lookup`: index lookups over ZMQ against a bare msgpack echo server.

Side by side in one run, on the same kind of socket (ROUTER on loopback, DEALER clients)
with the same request frames:

- the service: the real `ServiceServer` over a `GlobalIndex` holding 10,000 cached
  prompts of 2,048 tokens (16-token pages; 100 shared 512-token system prompts, each
  prompt stored by one of 4 workers), answering `match` requests with the codec's checks;
- the echo: a ROUTER that msgpack-decodes each request and answers with a msgpack-encoded
  canned reply of the same shape and size as the service's answer, without any checks or
  index work.

4 client processes each keep one request in flight, decode every reply with the real
codec, and count replies for a fixed time. Each server runs in a process of its own.
The phases alternate (echo, service, echo, service) so drift in the machine's load hits
both alike; `ratio` is the service's request rate over the echo's.

Both security settings run, each with its own pair of servers: as deployed (`ratio`):
CurveZMQ on both servers, clients admitted by the mesh's ZAP handler, each client speaking
with a worker's key and asking as that worker; and in plain text (`ratio_plain`). The
request frames are the same bytes in both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from cache_service import protocol, zap
from cache_service.auth import MeshKeys
from cache_service.events import Namespace, PagesStored
from cache_service.index import GlobalIndex
from cache_service.malloc import keep_large_blocks_mapped
from cache_service.messages import Match
from cache_service.server import ServerConfig, ServiceServer
from cache_service.tokens import pack_tokens

PAGE_TOKENS = 16
PROMPT_TOKENS = 2048
PROMPTS = 10_000
SYSTEM_PROMPTS = 100
SYSTEM_TOKENS = 512
WORKERS = 4
CLIENTS = 4
PHASE_S = 3.0
QUERIES = 256  # distinct request frames each client cycles through
NAMESPACE = Namespace("bench-lookup")
VOCAB = 49_152


def make_prompt_tokens(count: int, seed: int = 0) -> np.ndarray:
    """(count, PROMPT_TOKENS) int32: system prompt i % 100, then a random suffix."""
    rng = np.random.default_rng(seed)
    systems = rng.integers(0, VOCAB, (SYSTEM_PROMPTS, SYSTEM_TOKENS), dtype=np.int32)
    suffixes = rng.integers(0, VOCAB, (count, PROMPT_TOKENS - SYSTEM_TOKENS), dtype=np.int32)
    return np.concatenate([systems[np.arange(count) % SYSTEM_PROMPTS], suffixes], axis=1)


def build_index(prompts: np.ndarray) -> GlobalIndex:
    """The index as 4 workers' real event streams would leave it."""
    capacity = 1 << 20  # each worker's store holds every page it publishes here
    index = GlobalIndex(page_tokens=PAGE_TOKENS, liveness_timeout_s=3600.0, max_capacity=capacity)
    system_pages = SYSTEM_TOKENS // PAGE_TOKENS
    suffix_pages = (PROMPT_TOKENS - SYSTEM_TOKENS) // PAGE_TOKENS
    next_page = [0] * WORKERS
    system_tail: list[dict[int, int]] = [{} for _ in range(WORKERS)]
    seq = [0] * WORKERS
    epochs: list[int] = []
    for w in range(WORKERS):
        epochs.append(index.register(f"w{w}", "node-0", capacity=capacity).epoch)
    for j, prompt in enumerate(prompts):
        w, s = j % WORKERS, j % SYSTEM_PROMPTS
        events = []
        if s not in system_tail[w]:
            ids = tuple(range(next_page[w], next_page[w] + system_pages))
            next_page[w] += system_pages
            events.append(_stored(None, ids, prompt[:SYSTEM_TOKENS]))
            system_tail[w][s] = ids[-1]
        ids = tuple(range(next_page[w], next_page[w] + suffix_pages))
        next_page[w] += suffix_pages
        events.append(_stored(system_tail[w][s], ids, prompt[SYSTEM_TOKENS:]))
        seq[w] += 1
        result = index.apply_events(f"w{w}", epochs[w], seq[w], events)
        assert result.applied, result
    return index


def _stored(parent: int | None, ids: tuple[int, ...], tokens: np.ndarray) -> PagesStored:
    return PagesStored(NAMESPACE, parent, ids, (1,) * len(ids), tuple(tokens.tolist()))


def request_frames(prompts: np.ndarray, client: int = 0) -> list[bytes]:
    """The frames client `client` cycles through: matches asked as worker w{client}."""
    frames = []
    for i in range(QUERIES):
        tokens = pack_tokens(prompts[(i * 37 + client) % len(prompts)])
        body = Match(NAMESPACE, tokens, f"w{client % WORKERS}")
        frames.append(protocol.encode(protocol.request(i + 1, body)))
    return frames


def _curve_server(socket: zmq.Socket, keys: MeshKeys, context: zmq.Context) -> str:
    """Make `socket` a CURVE server that admits the mesh's keys, as the service does; the
    ZAP domain, to close before the context ends."""
    socket.curve_secretkey = keys.service.secret
    socket.curve_publickey = keys.service.public
    socket.curve_server = True
    domain = zap.open_domain(keys.server_keys().clients.keys(), context)
    socket.zap_domain = domain.encode()
    return domain


def _curve_client(socket: zmq.Socket, keys: MeshKeys, client: int) -> None:
    pair = keys.workers[f"w{client % WORKERS}"]
    socket.curve_secretkey = pair.secret
    socket.curve_publickey = pair.public
    socket.curve_serverkey = keys.service.public


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_rss(count: int) -> tuple[GlobalIndex, np.ndarray, int]:
    """The index of `count` prompts built in this process as the service's process would
    hold it: (index, prompts, RSS growth in bytes)."""
    keep_large_blocks_mapped()  # as the service actor does before its index takes events
    prompts = make_prompt_tokens(count)
    before = _rss_bytes()
    index = build_index(prompts)
    return index, prompts, _rss_bytes() - before


def _service_process(conn, count: int, keys: dict | None) -> None:
    mesh_keys = None if keys is None else MeshKeys.from_dict(keys)
    index, prompts, grown = index_rss(count)
    packed = [pack_tokens(p) for p in prompts[:QUERIES]]
    start = time.perf_counter()
    rounds = 0
    while time.perf_counter() - start < 1.0:
        for tokens in packed:
            index.match(NAMESPACE, tokens)
        rounds += 1
    pages_per_s = (
        rounds * len(packed) * (PROMPT_TOKENS // PAGE_TOKENS) / (time.perf_counter() - start)
    )
    pages = index.num_pages  # read now: once the server starts, its loop owns the index
    server = ServiceServer(
        index,
        ServerConfig(page_tokens=PAGE_TOKENS, liveness_timeout_s=3600),
        None if mesh_keys is None else mesh_keys.server_keys(),
    )
    address = server.start()
    # The echo's canned answer: what the service answers for a full hit, re-encoded plainly.
    canned = msgpack.unpackb(_ask(address, request_frames(prompts)[0], mesh_keys), raw=False)
    conn.send(
        {
            "address": address,
            "pages": pages,
            "bytes_per_page": grown / pages,
            "inprocess_pages_per_s": pages_per_s,
            "canned": canned,
            "matched_tokens": canned["b"]["matched_tokens"],
        }
    )
    conn.recv()  # wait for "stop"
    server.stop()
    index.check_integrity()
    conn.send("stopped")


def _ask(address: str, frame: bytes, keys: MeshKeys | None) -> bytes:
    """One request's reply, over a socket of its own (as client 0)."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    if keys is not None:
        _curve_client(socket, keys, 0)
    socket.connect(address)
    try:
        socket.send(frame)
        return socket.recv()
    finally:
        socket.close(linger=0)
        context.term()


def _echo_process(conn, canned: dict[str, Any], keys: dict | None) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.linger = 0
    domain = "" if keys is None else _curve_server(socket, MeshKeys.from_dict(keys), context)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not conn.poll():
        if poller.poll(100):
            for _ in range(256):
                try:
                    identity, frame = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                request = msgpack.unpackb(frame, raw=False)
                canned["id"] = request["id"]
                socket.send_multipart([identity, msgpack.packb(canned)])
    socket.close(linger=0)
    if domain:
        zap.close_domain(domain)
    context.term()


def _client_process(address, frames, keys, client, duration: float, start_at: float, out):
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    if keys is not None:
        _curve_client(socket, MeshKeys.from_dict(keys), client)
    socket.connect(address)
    latencies = []
    while time.time() < start_at:
        time.sleep(0.001)
    end = time.perf_counter() + duration
    i = 0
    while (now := time.perf_counter()) < end:
        socket.send(frames[i % len(frames)])
        reply = protocol.decode(socket.recv(), "reply")
        assert reply.type == protocol.OK, reply
        latencies.append(time.perf_counter() - now)
        i += 1
    socket.close(linger=0)
    context.term()
    out.put(latencies)


def _phase(address: str, frames, keys: dict | None, ctx, phase_s: float) -> list[float]:
    out = ctx.Queue()
    start_at = time.time() + 0.5  # all clients start together
    clients = [
        ctx.Process(
            target=_client_process,
            args=(address, frames[c], keys, c, phase_s, start_at, out),
        )
        for c in range(CLIENTS)
    ]
    for client in clients:
        client.start()
    latencies = [lat for _ in clients for lat in out.get(timeout=phase_s + 60)]
    for client in clients:
        client.join()
    return latencies


def _receive(conn, process, timeout_s: float = 600.0) -> Any:
    """The next message from a child process; raises if it died or went silent first."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not process.is_alive():
            raise RuntimeError(f"the {process.name} process exited with {process.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no word from the {process.name} process in {timeout_s:.0f}s")
    return conn.recv()


def run(log=sys.stderr, prompts: int = PROMPTS, phase_s: float = PHASE_S) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI).

    Args:
        log: where progress goes.
        prompts: cached prompts in the index (fewer for a quick check of the harness).
        phase_s: seconds each of the phases runs (four per security setting).
    """
    keys = MeshKeys.generate(f"w{w}" for w in range(WORKERS)).to_dict()
    secure, info = _side_by_side(log, prompts, phase_s, keys)
    plain, _ = _side_by_side(log, prompts, phase_s, None)
    return {
        "clients": CLIENTS,
        "prompts": prompts,
        "pages_indexed": info["pages"],
        **secure,
        **{f"{name}_plain": value for name, value in plain.items()},
        "inprocess_pages_per_s": round(info["inprocess_pages_per_s"]),
        "bytes_per_page": round(info["bytes_per_page"], 1),
    }


def _side_by_side(log, prompts: int, phase_s: float, keys: dict | None) -> tuple[dict, dict]:
    """Echo and service phases, alternating, under one security setting: the figures and
    what the service process reported."""
    setting = "authenticated (CurveZMQ)" if keys else "plain"
    ctx = mp.get_context("spawn")
    print(f"building an index of {prompts} prompts of {PROMPT_TOKENS} tokens ({setting})...",
          file=log)  # fmt: skip
    service_conn, child = ctx.Pipe()
    service = ctx.Process(target=_service_process, args=(child, prompts, keys), name="service")
    service.start()
    info = _receive(service_conn, service)
    assert info["matched_tokens"] == PROMPT_TOKENS, info["matched_tokens"]
    echo_conn, child = ctx.Pipe()
    echo = ctx.Process(target=_echo_process, args=(child, info["canned"], keys))
    echo.start()
    echo_address = echo_conn.recv()
    table = make_prompt_tokens(prompts)
    frames = [request_frames(table, c) for c in range(CLIENTS)]

    service_lat: list[float] = []
    echo_lat: list[float] = []
    service_s = echo_s = 0.0
    for round_ in range(2):
        print(f"{setting} round {round_ + 1}/2: echo, then service ({phase_s:.0f}s each)...",
              file=log)  # fmt: skip
        echo_lat += _phase(echo_address, frames, keys, ctx, phase_s)
        echo_s += phase_s
        service_lat += _phase(info["address"], frames, keys, ctx, phase_s)
        service_s += phase_s
    echo_conn.send("stop")
    echo.join()
    service_conn.send("stop")
    assert _receive(service_conn, service) == "stopped"
    service.join()

    lookups_per_s = len(service_lat) / service_s
    echo_per_s = len(echo_lat) / echo_s
    quantiles = statistics.quantiles(service_lat, n=100)
    echo_quantiles = statistics.quantiles(echo_lat, n=100)
    figures = {
        "lookups_per_s": round(lookups_per_s, 1),
        "echo_per_s": round(echo_per_s, 1),
        "ratio": round(lookups_per_s / echo_per_s, 3),
        "p50_us": round(quantiles[49] * 1e6, 1),
        "p99_us": round(quantiles[98] * 1e6, 1),
        "echo_p50_us": round(echo_quantiles[49] * 1e6, 1),
        "echo_p99_us": round(echo_quantiles[98] * 1e6, 1),
    }
    return figures, info
