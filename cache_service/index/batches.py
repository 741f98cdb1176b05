"""The order of a worker's event batches: which apply, which repeat, which ask for a resync.

Batches are numbered per worker incarnation from 1 after registration (or from a resync's
seq + 1):

    last applied seq = 7       seq 8: applies         seq <= 7: a repeat, ignored
                               seq 9 (8 missing): a gap, the worker must resync

A gap, an unknown worker or epoch, or a batch the chains could not place asks the worker
for a full resync; a worker marked desynced has its batches refused until the resync comes
and replaces all it holds. The outcomes are counted: the "events" section of the index's
statistics.
"""

from __future__ import annotations

from cache_service.index.registry import Worker
from cache_service.messages import ApplyResult


class BatchOrder:
    """Says whether each batch of a worker may apply, and counts every outcome."""

    def __init__(self) -> None:
        self.counts = {
            "batches": 0,
            "duplicates": 0,
            "resyncs_requested": 0,
            "resyncs": 0,
            "over_capacity": 0,  # batches and resyncs refused: past the worker's capacity
        }

    def sender_refusal(self, worker: Worker | None, epoch: int) -> ApplyResult | None:
        """The refusal of a message from an unknown worker (None) or another incarnation of
        it (`epoch`), which asks for a resync; None when the sender is current."""
        if worker is None:
            self.counts["resyncs_requested"] += 1
            return ApplyResult(False, True, "unknown_worker", 0)
        if epoch != worker.epoch:
            self.counts["resyncs_requested"] += 1
            return ApplyResult(False, True, "epoch_mismatch", worker.last_seq)
        return None

    def batch_refusal(self, worker: Worker | None, epoch: int, seq: int) -> ApplyResult | None:
        """Count one batch; the answer that refuses it, or None when it is the next one of a
        current worker in step with the index (then apply it, and answer `applied`)."""
        self.counts["batches"] += 1
        refusal = self.sender_refusal(worker, epoch)
        if refusal is not None:
            return refusal
        assert worker is not None
        if worker.desynced:
            return ApplyResult(False, True, "awaiting_resync", worker.last_seq)
        if seq <= worker.last_seq:
            self.counts["duplicates"] += 1
            reason = "duplicate" if seq == worker.last_seq else "stale"
            return ApplyResult(False, False, reason, worker.last_seq)
        if seq > worker.last_seq + 1:
            return self.desync(worker, "gap")
        return None

    def desync(self, worker: Worker, reason: str) -> ApplyResult:
        """Refuse `worker`'s batches from now on, until it resyncs; the answer says why."""
        worker.desynced = True
        self.counts["resyncs_requested"] += 1
        self.counts["over_capacity"] += reason == "over_capacity"
        return ApplyResult(False, True, reason, worker.last_seq)

    def over_capacity(self, worker: Worker, pages: int) -> ValueError:
        """Count a resync of `pages` refused past `worker`'s capacity; the error to raise."""
        self.counts["over_capacity"] += 1
        return ValueError(
            f"a resync of {pages} pages from {worker.worker_id!r}, over its capacity of "
            f"{worker.capacity} pages"
        )

    def applied(self, worker: Worker, seq: int) -> ApplyResult:
        """Batch `seq` of `worker` is applied: the next one is seq + 1."""
        worker.last_seq = seq
        return ApplyResult(True, False, "applied", seq)

    def resynced(self, worker: Worker, seq: int) -> ApplyResult:
        """`worker`'s holdings were replaced by a snapshot up to batch `seq`: it is in step
        again, and its next batch is seq + 1."""
        worker.last_seq, worker.desynced = seq, False
        self.counts["resyncs"] += 1
        return ApplyResult(True, False, "resynced", seq)
