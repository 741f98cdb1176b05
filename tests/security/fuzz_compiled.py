"""Coverage-guided fuzzing of the compiled entry points (atheris, libFuzzer's engine): the
index's (`cache_service.index._compiled`) and the wire's (`cache_service._native`).

Each input is read as a run of operations on a small index (pages of 2 tokens from a
3-token alphabet, so prefixes are shared, and 6 workers, more than the 4 inline holder
columns): stored, removed and demoted chains, clears and resyncs with page ids, parents,
generations, tiers and token counts that are sometimes wrong, matches and routes of any
tokens; and direct calls of the compiled objects (`Trie`, `PageMap`, `KeyTable`,
`ChainKeys`, `first_outside`) with arbitrary ints, node ids and bytes; and frames of any
bytes for the compiled MATCH reader, whatever it reads held to what the general decoder
reads, with token packing, page digests, their recording into a store's rows and the
msgpack scan (a frame it finds whole ends where msgpack's own skipper ends it) beside it.
A wrong argument may raise ValueError or TypeError and must change nothing; anything else
that raises, an `AssertionError` from `check_integrity()` after the run, or a crash of the
process (a memory error in the compiled code) is a finding: libFuzzer saves the input as crash-*.

    python tests/security/fuzz_compiled.py -max_total_time=60 [corpus_dir]

`tests/security/test_fuzz_compiled.py` runs it for a bounded time in CI.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import atheris
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests' helpers, run anywhere
with atheris.instrument_imports(include=["cache_service", "workers.cache"]):
    from cache_service import _native, protocol
    from cache_service.events import (
        REMOVAL_REASONS,
        TIERS,
        AllCleared,
        Namespace,
        PagesDemoted,
        PagesRemoved,
        PagesStored,
    )
    from cache_service.index import GlobalIndex
    from cache_service.index._compiled import ChainKeys, KeyTable, PageMap, first_outside
    from cache_service.messages import Match
    from cache_service.protocol import PROTOCOL_VERSION, ProtocolError
    from cache_service.protocol.codec import _decode_frame, _match_limits
    from cache_service.tokens import pack_tokens
    from tests.workers.cache_helpers import RecordingPool
    from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig

P = 2  # tokens per page
WORKERS = [f"w{i}" for i in range(6)]
NAMESPACES = [Namespace("m"), Namespace("m", salt="t")]
OPS = 48  # operations per input at most
BAD_IDS = (-1, 2**31, 2**63 - 1, -(2**63))


class Run:
    """One input's index, its workers' epochs and batch numbers; a local prefix cache of a
    few pages (its walk is compiled), the allocations it holds."""

    def __init__(self) -> None:
        self.index = GlobalIndex(page_tokens=P, max_workers=8)
        self.epochs = {w: self.index.register(w, "n0", now=0.0).epoch for w in WORKERS}
        self.seqs = dict.fromkeys(WORKERS, 0)
        self.pool = RecordingPool(24, page_tokens=P)
        self.cache = PrefixCache(self.pool, PrefixCacheConfig(page_tokens=P, chunk_tokens=0))
        self.held = []


def page_id(data: atheris.FuzzedDataProvider) -> int:
    """Mostly a small id (reused often), sometimes one outside int32."""
    if data.ConsumeIntInRange(0, 15) == 0:
        return BAD_IDS[data.ConsumeIntInRange(0, len(BAD_IDS) - 1)]
    return data.ConsumeIntInRange(0, 24)


def page_ids(data: atheris.FuzzedDataProvider, most: int = 5) -> list[int]:
    return [page_id(data) for _ in range(data.ConsumeIntInRange(0, most))]


def tokens(data: atheris.FuzzedDataProvider, pages: int) -> list[int]:
    count = pages * P
    if data.ConsumeIntInRange(0, 15) == 0:
        count += data.ConsumeIntInRange(-1, 1)  # sometimes not whole pages
    return [data.ConsumeIntInRange(0, 2) for _ in range(max(count, 0))]


def tier(data: atheris.FuzzedDataProvider) -> str:
    return "nvme" if data.ConsumeIntInRange(0, 31) == 0 else data.PickValueInList(list(TIERS))


def generations(data: atheris.FuzzedDataProvider, count: int) -> list[int]:
    values = [data.ConsumeIntInRange(0, 9) for _ in range(count)]
    if values and data.ConsumeIntInRange(0, 31) == 0:
        values[0] = -1
    return values


def event(data: atheris.FuzzedDataProvider):
    kind = data.ConsumeIntInRange(0, 5)
    if kind <= 2:
        ids = page_ids(data)
        parent = None if data.ConsumeBool() else page_id(data)
        namespace = data.PickValueInList(NAMESPACES)
        return PagesStored(
            namespace, parent, ids, generations(data, len(ids)), tokens(data, len(ids)), tier(data)
        )
    if kind == 3:
        reason = data.PickValueInList([*REMOVAL_REASONS, "bogus"])
        return PagesRemoved(page_ids(data), reason, tier(data))
    if kind == 4:
        ids = page_ids(data)
        new = [page_id(data) for _ in ids]
        return PagesDemoted(ids, new, generations(data, len(ids)), tier(data))
    return AllCleared()


def apply(run: Run, data: atheris.FuzzedDataProvider) -> None:
    worker = data.PickValueInList(WORKERS)
    run.seqs[worker] += data.ConsumeIntInRange(0, 1)  # sometimes a batch again
    events = [event(data) for _ in range(data.ConsumeIntInRange(1, 3))]
    result = run.index.apply_events(worker, run.epochs[worker], run.seqs[worker], events)
    if result.reason == "resync_required" or not result.applied:
        resync(run, worker, data)


def resync(run: Run, worker: str, data: atheris.FuzzedDataProvider) -> None:
    chains, used, parent = [], set(), None
    for _ in range(data.ConsumeIntInRange(0, 3)):
        ids = [i for i in dict.fromkeys(page_ids(data, 3)) if i not in used and 0 <= i < 2**31]
        if not ids:
            continue
        page_tokens = [data.ConsumeIntInRange(0, 2) for _ in range(P * len(ids))]
        chains.append(PagesStored(NAMESPACES[0], parent, ids, [1] * len(ids), page_tokens))
        used.update(ids)
        parent = ids[-1] if data.ConsumeBool() else None
    seq = data.ConsumeIntInRange(0, 100)
    run.index.resync(worker, run.epochs[worker], seq, chains)
    run.seqs[worker] = seq


def raw_calls(run: Run, data: atheris.FuzzedDataProvider) -> None:
    """The compiled objects called directly, with arbitrary ints and bytes."""
    nodes = run.index._nodes
    trie = nodes.trie
    any_int = data.ConsumeIntInRange(-(2**40), 2**40)
    blob = data.ConsumeBytes(data.ConsumeIntInRange(0, 40))
    kind = data.ConsumeIntInRange(0, 9)
    if kind == 0:
        trie.walk(any_int if data.ConsumeBool() else None, blob, data.ConsumeIntInRange(0, 5))
    elif kind == 1:
        trie.match(any_int, blob, data.ConsumeIntInRange(0, 5), None)
    elif kind == 2:  # writes that must be refused before they change anything
        trie.store(PageMap(), 0, any_int, blob, [0], [0], 0, 0)
    elif kind == 3:
        trie.column_of(any_int, data.ConsumeIntInRange(-5, 10))
    elif kind == 4:
        trie.extra(any_int)
    elif kind == 5:
        table = KeyTable()
        for _ in range(data.ConsumeIntInRange(0, 20)):
            key = data.ConsumeIntInRange(-(2**63), 2**63 - 1) | 1
            node = data.ConsumeIntInRange(0, 5)
            if data.ConsumeBool():
                table.insert(key, node)
            else:
                with contextlib.suppress(KeyError):  # not there: said so, nothing changed
                    table.remove(key, node)
            table.candidates(key)
        table.check()
    elif kind == 6:
        keys = ChainKeys(P, data.ConsumeIntInRange(0, 2**64 - 1))
        keys.chain_keys(any_int | 1, data.ConsumeIntInRange(0, 2**30), blob)
        keys.page_key(any_int | 1, data.ConsumeIntInRange(0, 20), blob)
    elif kind == 7:
        pages = PageMap()
        for _ in range(data.ConsumeIntInRange(0, 10)):
            page = data.ConsumeIntInRange(-5, 2**32)
            pages.set(page, data.ConsumeIntInRange(-5, 2**32))
            pages.get(page)
            pages.pop(data.ConsumeIntInRange(-5, 2**32))
        pages.items()
    elif kind == 8:
        count = data.ConsumeIntInRange(0, 6)
        values = [data.ConsumeIntInRange(-(2**70), 2**70) for _ in range(count)]
        first_outside(values, data.ConsumeIntInRange(-10, 10), any_int, data.ConsumeBool())
    else:
        trie.drop_subtree(PageMap(), 0, any_int, True)


def wire_calls(data: atheris.FuzzedDataProvider) -> None:
    """The compiled wire readers on arbitrary bytes: a MATCH frame (mostly a real one with
    a few bytes changed), token ids, pages to digest, any frame for the msgpack scan."""
    kind = data.ConsumeIntInRange(0, 4)
    if kind == 0:
        limits = protocol.DEFAULT_LIMITS
        if data.ConsumeBool():
            frame = bytearray(_MATCH_FRAME)
            for _ in range(data.ConsumeIntInRange(1, 4)):
                frame[data.ConsumeIntInRange(0, len(frame) - 1)] = data.ConsumeIntInRange(0, 255)
            frame = bytes(frame)
        else:
            frame = data.ConsumeBytes(data.ConsumeIntInRange(0, 200))
        fields = _native.read_match(frame, PROTOCOL_VERSION, *_match_limits(limits))
        if fields is not None:  # taken: the general decoder must read the same request
            message = _decode_frame(frame, "request", limits)
            body = message.body
            assert (message.request_id, *body.namespace, body.tokens, body.requester) == fields
    elif kind == 1:
        ids = [data.ConsumeIntInRange(-(2**40), 2**40) for _ in range(data.ConsumeIntInRange(0, 9))]
        packed = _native.pack_int32(ids)
        assert packed is None or packed == pack_tokens(ids)
    elif kind == 2:
        parent = data.ConsumeBytes(16)
        _native.chain_digests(parent, data.ConsumeBytes(100), data.ConsumeIntInRange(1, 40))
    elif kind == 3:
        record_digests(data)
    else:
        frame = data.ConsumeBytes(data.ConsumeIntInRange(0, 300))
        status, offset = _native.scan_msgpack(frame, data.ConsumeIntInRange(0, 40), 1024)
        assert 0 <= offset <= len(frame)
        if status in (0, 3):  # whole (then trailing bytes, or none): msgpack reads as far
            skipper = msgpack.Unpacker(max_buffer_size=max(len(frame), 1))
            skipper.feed(frame)
            skipper.skip()
            assert skipper.tell() == offset


def record_digests(data: atheris.FuzzedDataProvider) -> None:
    """Digests recorded into 8 pages' rows: all of them or none, the first fault named."""
    free = bytearray(data.ConsumeIntInRange(0, 1) for _ in range(8))
    view = bytearray(8 * 16)
    count = data.ConsumeIntInRange(0, 4)
    pages = [data.ConsumeIntInRange(-2, 9) for _ in range(count)]
    digests = [data.ConsumeBytes(data.ConsumeIntInRange(15, 17)) for _ in range(count)]
    if data.ConsumeBool():
        digests = [bytes(16) if data.ConsumeBool() else d for d in digests]
    fault = _native.record_digests(view, free, pages, digests)
    if fault is None:
        assert all(
            0 <= p < 8 and not free[p] and len(d) == 16 and any(d)
            for p, d in zip(pages, digests, strict=True)
        )
        last = dict(zip(pages, digests, strict=True))  # the last write of a page wins
        for page in range(8):
            assert view[16 * page : 16 * page + 16] == last.get(page, bytes(16))
    else:
        assert view == bytearray(8 * 16) and 0 <= fault[1] < count


def local_cache(run: Run, data: atheris.FuzzedDataProvider) -> None:
    """A batch acquired from the local cache, computed, published in part, some released:
    every slot a hit reuses holds exactly its own token's KV."""
    count = data.ConsumeIntInRange(1, 3)
    prompts = [tokens(data, data.ConsumeIntInRange(1, 5)) for _ in range(count)]
    entries = run.cache.acquire_batch(prompts, data.PickValueInList(NAMESPACES))
    for entry in entries or ():
        allocation = entry.allocation
        run.pool.assert_holds(allocation, entry.compute_from)
        run.pool.write(allocation, entry.compute_from, allocation.num_tokens)
        allocation.publish(data.ConsumeIntInRange(0, allocation.num_tokens))
        run.held.append(allocation)
    while run.held and data.ConsumeBool():
        run.held.pop(data.ConsumeIntInRange(0, len(run.held) - 1)).release()


_MATCH_FRAME = protocol.encode(
    protocol.request(9, Match(NAMESPACES[0], pack_tokens([1, 2, 3, 4]), "w0"))
)


def one_input(raw: bytes) -> None:
    data = atheris.FuzzedDataProvider(raw)
    run = Run()
    for _ in range(OPS):
        if data.remaining_bytes() == 0:
            break
        kind = data.ConsumeIntInRange(0, 9)
        try:
            if kind == 9:
                local_cache(run, data)
            elif kind == 8:
                wire_calls(data)
            elif kind <= 3:
                apply(run, data)
            elif kind == 4:
                namespace = data.PickValueInList(NAMESPACES)
                run.index.match_packed(namespace, pack_tokens(tokens(data, 4)), "w0")
            elif kind == 5:
                loads = {w: float(data.ConsumeIntInRange(0, 9)) for w in WORKERS[:3]}
                run.index.route(NAMESPACES[0], tokens(data, 3), loads)
            elif kind == 6:
                raw_calls(run, data)
            else:
                worker = data.PickValueInList(WORKERS)
                run.index.remove_worker(worker, "dead", run.epochs[worker])
                run.epochs[worker] = run.index.register(worker, "n0", now=0.0).epoch
                run.seqs[worker] = 0
        except (ValueError, TypeError, ProtocolError):
            pass  # refused: and nothing changed, which the integrity check below confirms
    run.index.check_integrity()
    run.cache.check_integrity()


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
