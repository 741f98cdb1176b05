"""Scale the Mooncake conversation trace down to what two CPU workers serve in a minute,
keeping its shape: `python -m benchmarks.trace_scale SOURCE [OUT]`.

The source (Mooncake FAST'25 conversation trace, Apache-2.0) holds 12,031 requests over
an hour, each a list of 512-token blocks (`hash_ids`, block 0 shared by every request)
with its input and output lengths. What the scaled trace keeps:

- whole conversations: a request belongs to the conversation of the earliest request
  it shares two or more leading blocks with (later turns extend earlier ones), and a
  conversation is taken with all its turns, so its prefix sharing is the source's;
- conversations drawn at random (a fixed seed) until there are `REQUESTS` requests,
  leaving out those whose longest prompt passes `MAX_INPUT` tokens;
- every length divided by `SCALE` (a block of 512 tokens becomes 16, one kvmesh page;
  input and output lengths rounded up, at least one token), hash ids renumbered from 0
  in order of first use, timestamps (ms) counted from the first request kept.

The result is Mooncake-format JSON lines whose hash ids stand for `BLOCK_TOKENS`-token
blocks; `benchmarks/traces/README.md` names the source, its license and these figures.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SOURCE_BLOCK_TOKENS = 512
SCALE = 32
BLOCK_TOKENS = SOURCE_BLOCK_TOKENS // SCALE  # 16: one kvmesh page
REQUESTS = 64
MAX_INPUT = 32_768  # source tokens: 1,024 once scaled (SmolLM2 computes it in ~2.5 s here)
SEED = 0
SCALED = Path(__file__).resolve().parent / "traces" / "conversation_scaled.jsonl"


def conversations(rows: list[dict]) -> dict[int, list[int]]:
    """Conversation (the index of its first request) -> the indexes of its requests."""
    first_of: dict[tuple[int, ...], int] = {}  # a leading run of 2+ blocks -> conversation
    out: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        blocks = tuple(row["hash_ids"])
        found = next(
            (first_of[blocks[:k]] for k in range(len(blocks), 1, -1) if blocks[:k] in first_of),
            i,
        )
        out.setdefault(found, []).append(i)
        for k in range(2, len(blocks) + 1):
            first_of.setdefault(blocks[:k], found)
    return out


def scale(rows: list[dict], requests: int = REQUESTS, seed: int = SEED) -> list[dict]:
    """The scaled trace (see the module's docstring), in the source's order."""
    chains = conversations(rows)
    order = list(chains)
    random.Random(seed).shuffle(order)
    kept: list[int] = []
    for first in order:
        if len(kept) >= requests:
            break
        if max(rows[i]["input_length"] for i in chains[first]) <= MAX_INPUT:
            kept += chains[first]
    kept.sort()
    ids: dict[int, int] = {}
    start = rows[kept[0]]["timestamp"]
    out = []
    for i in kept:
        row = rows[i]
        out.append(
            {
                "timestamp": row["timestamp"] - start,
                "input_length": -(-row["input_length"] // SCALE),
                "output_length": max(1, -(-row["output_length"] // SCALE)),
                "hash_ids": [ids.setdefault(h, len(ids)) for h in row["hash_ids"]],
            }
        )
    return out


def infinite_hit_rate(rows: list[dict]) -> float:
    """Blocks found as a leading run of blocks seen before, over all blocks (an infinite
    cache, any worker)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for row in rows:
        blocks = tuple(row["hash_ids"])
        total += len(blocks)
        hit += next((k for k in range(len(blocks), 0, -1) if blocks[:k] in seen), 0)
        seen.update(blocks[:k] for k in range(1, len(blocks) + 1))
    return hit / total


def main(argv: list[str]) -> None:
    if not 1 <= len(argv) <= 2:
        sys.exit("usage: python -m benchmarks.trace_scale SOURCE [OUT]")
    rows = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line]
    scaled = scale(rows)
    out = Path(argv[1]) if len(argv) > 1 else SCALED
    out.write_text("".join(json.dumps(row) + "\n" for row in scaled))
    print(
        f"{len(scaled)} requests, {len(conversations(scaled))} conversations, infinite-cache "
        f"hit rate {infinite_hit_rate(scaled):.3f} (source {infinite_hit_rate(rows):.3f}) -> {out}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
