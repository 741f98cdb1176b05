"""Where a worker's KV pages live: the shared-memory page store (`page_store`), built of its
layout and exceptions (`layout`), its named segment (`segment`, named and reclaimed by
`segment_names`), its free lists (`page_pool`) and its validated copies (`validated_copy`),
and the chain digests that say what each page holds (`digests`)."""
