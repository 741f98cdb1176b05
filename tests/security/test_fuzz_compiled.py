"""A bounded run of the coverage-guided fuzzer of the compiled entry points
(fuzz_compiled.py): no input may crash the process, raise anything but a refusal, leave
the index or a local prefix cache failing its integrity check, serve a slot another
token's KV, or be read by the compiled MATCH reader otherwise than the general decoder
reads it.

The run is short (FUZZ_S); a longer one is `python tests/security/fuzz_compiled.py
-max_total_time=N corpus_dir`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FUZZ_S = 40
HARNESS = Path(__file__).with_name("fuzz_compiled.py")


def test_the_fuzzer_finds_nothing_in_a_bounded_run(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            f"-max_total_time={FUZZ_S}",
            "-print_final_stats=1",
            "-rss_limit_mb=4096",  # the instrumentation grows a little with every input
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=FUZZ_S + 120,
        cwd=tmp_path,
    )
    log = out.stderr[-4000:]
    assert out.returncode == 0, log
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), log
    runs = int(
        next(
            line for line in out.stderr.splitlines() if "stat::number_of_executed_units" in line
        ).split()[-1]
    )
    assert runs > 1000, log  # it ran, and fast enough to mean something
    assert len(list(corpus.iterdir())) > 10, log  # coverage guided it to new inputs
