"""A slow link, for tests: a page source (`workers.transfer.copy_in.PageSource`) wrapped so
that each fetch first waits `delay_s` a page, as a slow network would."""

from __future__ import annotations

import time
from typing import Any

from workers.transfer.copy_in import PageSource


class SlowLink:
    """`source`, with `delay_s` a page before each fetch."""

    def __init__(self, source: PageSource, delay_s: float):
        self.source = source
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)  # worker_id, node_id, remote, pages_copied, ...

    def fetch(self, pages, gens, digests, targets, store) -> list[bool]:
        time.sleep(self.delay_s * len(pages))
        return self.source.fetch(pages, gens, digests, targets, store)

    def close(self) -> None:
        self.source.close()


def slow_down(monkeypatch, sources: Any, holder: str, delay_s: float) -> None:
    """Make every source `sources` (a `Sources`) hands out for `holder` a slow link."""
    get = sources.get

    def slowed(peer):
        source = get(peer)
        return SlowLink(source, delay_s) if peer.worker_id == holder else source

    monkeypatch.setattr(sources, "get", slowed)
