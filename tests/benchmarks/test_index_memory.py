"""The global index's memory per page (tracemalloc), the figure `bench lookup` reports as RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.index_memory import measure_bytes_per_page


def test_memory_per_page_stays_lean():
    per_page = measure_bytes_per_page(100_000, page_tokens=16)
    assert 100 < per_page <= 300, f"{per_page:.1f} bytes per page"


def test_measure_rejects_no_pages():
    with pytest.raises(ValueError, match="n_pages must be positive, got 0"):
        measure_bytes_per_page(0)


# In a fresh process: the RSS of a service process that has built the index of
# `kvmesh bench lookup` (10,000 prompts of 2,048 tokens, about 963,000 pages).
RSS_PROBE = """\
from benchmarks.lookup import index_rss
index, _, grown = index_rss(10_000)
print(index.num_pages, grown / index.num_pages)
"""


@pytest.mark.slow
def test_a_million_pages_cost_the_service_process_at_most_250_bytes_each():
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE], capture_output=True, text=True, timeout=300, check=True
    )
    pages, per_page = out.stdout.split()
    assert int(pages) > 900_000
    assert float(per_page) <= 250, f"{float(per_page):.1f} bytes of RSS per page"
