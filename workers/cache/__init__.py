"""The worker's local prefix cache: a page-granular radix trie over token ids, with
reference counts, eviction policies and the events the service hears. A module per role:

    prefix_cache.py   PrefixCache, what requests call: acquire, publish, release, evict
    config.py         its configuration and counters
    allocation.py     what a request holds: its pages, the trie chain it references
    runs.py           the trie's node (a run of pages) and comparisons of packed keys
    trie.py           the trie: namespace roots, making and splitting runs, the match walk
    evictor.py        references, evictable pages and the heap that ranks them
    eviction.py       the eviction policies, behind a registry
    events.py         the stored events and the snapshot for a resync
    integrity.py      every invariant, checked in full

Nothing here imports torch, Ray or ZeroMQ.
"""
