"""The `kvmesh` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence

BENCHMARKS: dict[str, str] = {
    "local": "the local prefix cache against an allocator that shares nothing",
    "lookup": "index lookups over ZMQ against a bare msgpack echo server",
    "copy": "page copies between workers against plain copies of the same bytes",
    "ttft": "time to first token with the real model: cold, local hit, remote hit",
}


def _bench_runner(name: str) -> Callable[[], dict]:
    # Imported on demand: each benchmark pulls in only what it measures.
    module = importlib.import_module(f"benchmarks.{name}")
    return module.run


def _print_table(figures: dict) -> None:
    width = max(len(key) for key in figures)
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")


def cmd_bench(args: argparse.Namespace) -> int:
    figures = _bench_runner(args.name)()
    if not args.json:
        print(f"kvmesh bench {args.name}: {BENCHMARKS[args.name]}")
        _print_table(figures)
    print(json.dumps(figures, sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh", description="A distributed, prefix-sharing KV-cache service on Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="run a benchmark; the last line is one JSON object")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print only the JSON line")
    bench.set_defaults(func=cmd_bench)
    replay = commands.add_parser(
        "replay", help="replay a Mooncake trace through the real index and local caches"
    )
    from benchmarks import replay as replay_module

    replay_module.add_arguments(replay)
    replay.set_defaults(func=replay_module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
