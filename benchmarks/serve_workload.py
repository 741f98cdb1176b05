"""The workloads of `kvmesh bench serve`: jobs of one or more turns, and how a client
sends a job's turns.

- `demo`: the demo's texts. 24 single questions, eight for each of three system prompts
  (300-350 tokens each), and eight conversations of five turns (two scripts, four
  customers each): a turn's prompt is the whole conversation so far, the earlier
  answers included, so a conversation's turns go one after the other. 16 new tokens a
  request.
- `trace`: `benchmarks/traces/conversation_scaled.jsonl`, the Mooncake conversation
  trace scaled down (see `benchmarks.trace_scale`): 37 conversations, 64 requests, each
  request's prompt the synthetic tokens of its blocks (a block of 16 tokens per hash id,
  as `kvmesh replay` makes them), cut to its input length, and its output length in new
  tokens. A conversation's turns go one after the other, in the trace's order.

Each request asks for its new tokens with the model's end of turn ignored, so every
request does the same work under every policy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.replay import block_tokens
from benchmarks.trace_scale import BLOCK_TOKENS, SCALED, conversations
from cluster.demo_prompts import CONVERSATIONS, QUESTIONS, SYSTEM_PROMPTS

WORKLOADS = ("demo", "trace")
NEW_TOKENS = 16  # a demo request's new tokens
CUSTOMERS = 4  # instances of each demo conversation script
SEED = 11  # the order of the demo's jobs


class Turn(NamedTuple):
    """One request of a job: a demo turn's user message (its prompt is the conversation
    so far), or a trace turn's prompt as it is."""

    new_tokens: int
    text: str = ""
    tokens: tuple[int, ...] = ()


class Job(NamedTuple):
    """What one client sends in turn: a conversation, or a single question."""

    system: str  # the demo's system prompt (a SYSTEM_PROMPTS key); "" for a trace job
    turns: tuple[Turn, ...]


# ask(prompt tokens, new tokens) -> the front door's result (its `.text` and `.stats`)
Ask = Callable[[list[int], int], Any]


def jobs(workload: str) -> list[Job]:
    """The workload's jobs, in the order clients take them.

    Raises:
        ValueError: an unknown workload.
    """
    if workload == "demo":
        return _demo_jobs()
    if workload == "trace":
        return trace_jobs(SCALED)
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def requests_of(chosen: list[Job]) -> int:
    return sum(len(job.turns) for job in chosen)


def _demo_jobs() -> list[Job]:
    out = [Job(system, (Turn(NEW_TOKENS, q),)) for system, qs in QUESTIONS.items() for q in qs]
    for system, turns in CONVERSATIONS:
        for customer in range(CUSTOMERS):
            texts = [f"(Customer {customer + 1}.) {turns[0]}", *turns[1:]]
            out.append(Job(system, tuple(Turn(NEW_TOKENS, text) for text in texts)))
    random.Random(SEED).shuffle(out)
    return out


def trace_jobs(path: Path) -> list[Job]:
    """A scaled Mooncake-format trace's conversations, by their first request's order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for _, members in sorted(conversations(rows).items()):
        turns = []
        for i in members:
            row = rows[i]
            tokens = [int(t) for h in row["hash_ids"] for t in block_tokens(h, BLOCK_TOKENS)]
            turns.append(Turn(row["output_length"], tokens=tuple(tokens[: row["input_length"]])))
        out.append(Job("", tuple(turns)))
    return out


def run_job(job: Job, ask: Ask, tokenizer: Any) -> None:
    """Send a job's turns one after the other (a demo turn after the answers before it)."""
    if not job.system:
        for turn in job.turns:
            ask(list(turn.tokens), turn.new_tokens)
        return
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[job.system]}]
    for turn in job.turns:
        messages.append({"role": "user", "content": turn.text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        answer = ask(list(tokenizer.encode(text)), turn.new_tokens)
        messages.append({"role": "assistant", "content": answer.text})
