"""The global index's memory per page (tracemalloc), the figure `bench lookup` reports as RSS."""

from __future__ import annotations

import pytest

from benchmarks.index_memory import measure_bytes_per_page


def test_memory_per_page_stays_lean():
    per_page = measure_bytes_per_page(100_000, page_tokens=16)
    assert 100 < per_page <= 300, f"{per_page:.1f} bytes per page"


def test_measure_rejects_no_pages():
    with pytest.raises(ValueError, match="n_pages must be positive, got 0"):
        measure_bytes_per_page(0)
