"""The worker's local prefix cache: a page-granular radix trie over token ids, with
reference counts, eviction policies and the events the service hears."""
