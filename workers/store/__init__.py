"""Where a worker's KV pages live: the shared-memory page store (`page_store`), its free
lists (`page_pool`) and the chain digests that say what each page holds (`digests`)."""
