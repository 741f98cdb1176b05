"""The `kvmesh` command line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence

BENCHMARKS: dict[str, str] = {
    "local": "the local prefix cache against an allocator that shares nothing",
    "lookup": "index lookups over ZMQ against a bare msgpack echo server",
    "index": "the global index alone, on the Mooncake trace: queries and events per second",
    "copy": "page copies between workers against plain copies of the same bytes",
    "ttft": "time to first token with the real model: cold, local, remote, several holders",
    "chaos": "a shared-prefix workload kept correct while workers, service and traffic fail",
    "batch": "a worker's batches with same-batch prefix sharing, without it, and one by one",
    "serve": "routing under load: kvmesh's against the baselines, with and without the mesh",
    "vllm": "vLLM engines sharing a prefix through kvmesh's connector, against recomputing it",
    "ray-serve": "a Ray Serve LLM app: kvmesh's router and connector against Ray Serve's routers",
    "compaction": "quality against memory freed for StreamingLLM, H2O and SnapKV on real prose",
    "tiers": "the disk tier: TTFT from shared memory, from disk and cold; a restarted worker",
}


# Options some benchmarks take (a keyword of their run()); unset ones are not passed.
BENCH_OPTIONS = ("repeats", "workload", "arrivals", "front_doors")


def _bench_runner(name: str) -> Callable[[], dict]:
    # Imported on demand: each benchmark pulls in only what it measures.
    module = importlib.import_module(f"benchmarks.{name.replace('-', '_')}")
    return module.run


def _print_table(figures: dict) -> None:
    width = max(len(key) for key in figures)
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")


def cmd_bench(args: argparse.Namespace) -> int:
    runner = _bench_runner(args.name)
    options = {}
    accepted = inspect.signature(runner).parameters
    for option in BENCH_OPTIONS:
        value = getattr(args, option)
        if value is None:
            continue
        if option not in accepted:
            flag = "--" + option.replace("_", "-")
            print(f"kvmesh bench {args.name} takes no {flag}", file=sys.stderr)
            return 2
        options[option] = value
    if options.get("repeats", 1) < 1:
        print(f"--repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    figures = runner(**options)
    if not args.json:
        print(f"kvmesh bench {args.name}: {BENCHMARKS[args.name]}")
        _print_table(figures)
    print(json.dumps(figures, sort_keys=False))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cluster.demo import demo_console, run_demo

    # With --json, stdout carries the JSON line only: the tables go to stderr.
    if not args.scale > 0:
        print(f"kvmesh demo: --scale must be > 0, got {args.scale}", file=sys.stderr)
        return 2
    out = demo_console(sys.stderr if args.json else sys.stdout)
    try:
        figures = run_demo(args.config, log=sys.stderr, scale=args.scale, out=out)
    except KeyboardInterrupt:
        print("kvmesh demo: interrupted; the mesh is stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(figures, sort_keys=False))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from cluster import launch
    from cluster.status import render_status

    status = launch.up(
        args.config, args.address, min_nodes=args.min_nodes, nodes_timeout_s=args.nodes_timeout
    )
    print(render_status(status), end="")
    print(f"kvmesh is up: Ray at {status['ray_address']}; `kvmesh down` stops it")
    print(f"an enrollment token for one vLLM engine: {launch.enrollment_tokens()[0]}")
    print("(`kvmesh enroll-token` issues more; each is spent by the engine that joins with it)")
    return 0


def cmd_enroll_token(args: argparse.Namespace) -> int:
    from cluster import launch

    for token in launch.enrollment_tokens(args.count, args.engines):
        print(token)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from cluster import launch

    if launch.down(args.address):
        print("kvmesh is down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster import launch
    from cluster.status import render_status

    with launch.attached(args.address) as mesh:
        status = mesh.stats()
    if args.json:
        print(json.dumps(status, sort_keys=True))
    else:
        print(render_status(status), end="")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from cluster import launch
    from cluster.status import run_top

    with launch.attached(args.address) as mesh, contextlib.suppress(KeyboardInterrupt):
        run_top(mesh.stats, interval_s=args.interval)
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    import time

    import ray

    from cache_service.actor import get_service
    from cluster import launch

    with launch.attached(args.address):
        service = get_service()
        if args.clear:
            if not ray.get(service.clear_quarantine.remote(args.clear), timeout=30):
                print(f"kvmesh quarantine: {args.clear!r} is not in quarantine", file=sys.stderr)
                return 1
            print(f"{args.clear} may register again")
            return 0
        records = ray.get(service.quarantined.remote(), timeout=30)
    if args.json:
        print(json.dumps(records, sort_keys=True))
    elif not records:
        print("no member is in quarantine")
    for record in [] if args.json else records:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
        print(f"{record['holder']}: reported by {record['reporter']} at {since}")
        print(f"  {record['evidence']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="A distributed, prefix-sharing KV-cache service on Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="run a benchmark; the last line is one JSON object")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print only the JSON line")
    bench.add_argument(
        "--repeats", type=int, help="how often to repeat the whole set (benchmarks that do: serve)"
    )
    bench.add_argument(
        "--workload", choices=("demo", "trace"), help="serve: the demo's prompts or the trace's"
    )
    bench.add_argument(
        "--arrivals",
        choices=("closed", "open"),
        help="serve: closed-loop clients, or open-loop Poisson arrivals",
    )
    bench.add_argument(
        "--front-doors", type=int, choices=(1, 2), help="serve: front doors sending at once"
    )
    bench.set_defaults(func=cmd_bench)
    demo = commands.add_parser(
        "demo", help="the main job: a shared-prefix workload on an embedded mesh, with tables"
    )
    demo.add_argument("--config", help="the YAML configuration (default configs/local.yaml)")
    demo.add_argument("--json", action="store_true", help="end with one JSON line on stdout")
    demo.add_argument(
        "--scale", type=float, default=1.0, help="multiply the number of requests (default 1.0)"
    )
    demo.set_defaults(func=cmd_demo)
    address_help = "the Ray cluster's address (default: the one `kvmesh up` recorded)"
    up = commands.add_parser("up", help="start the service and the workers, and leave them running")
    up.add_argument("--config", required=True, help="the YAML configuration (configs/*.yaml)")
    up.add_argument(
        "--address",
        help="a running Ray cluster to start in ('auto': the one on this machine); "
        "default: start a Ray head of kvmesh's own on this machine",
    )
    up.add_argument(
        "--min-nodes",
        type=int,
        default=1,
        help="wait for this many live Ray nodes before placing the workers (default 1)",
    )
    up.add_argument("--nodes-timeout", type=float, default=600.0, help="seconds to wait for them")
    up.set_defaults(func=cmd_up)
    enroll = commands.add_parser(
        "enroll-token",
        help="issue one-time tokens for vLLM engines to join the mesh `kvmesh up` started here",
    )
    enroll.add_argument("--count", type=int, default=1, help="how many (default 1), one a line")
    enroll.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines each token enrolls (default 1; a Ray Serve deployment's replicas share one)",
    )
    enroll.set_defaults(func=cmd_enroll_token)
    down = commands.add_parser("down", help="stop what `kvmesh up` started")
    down.add_argument("--address", help=address_help)
    down.set_defaults(func=cmd_down)
    status = commands.add_parser("status", help="workers, pages and hit rates of the running mesh")
    status.add_argument("--address", help=address_help)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)
    top = commands.add_parser("top", help="a live view of the running mesh, refreshed every second")
    top.add_argument("--address", help=address_help)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.set_defaults(func=cmd_top)
    quarantine = commands.add_parser(
        "quarantine",
        help="members whose pages failed a spot check (refused until cleared); --clear one",
    )
    quarantine.add_argument("--address", help=address_help)
    quarantine.add_argument("--clear", metavar="WORKER", help="let this member register again")
    quarantine.add_argument("--json", action="store_true", help="print one JSON list")
    quarantine.set_defaults(func=cmd_quarantine)
    replay = commands.add_parser(
        "replay", help="replay a Mooncake trace through the real index and local caches"
    )
    from benchmarks import replay as replay_module

    replay_module.add_arguments(replay)
    replay.set_defaults(func=replay_module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cluster.config import ConfigError
    from cluster.errors import KvmeshError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 2
    except KvmeshError as exc:
        print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
