"""Where a worker's KV pages live: the shared-memory page store (`page_store`: creating and
attaching it, the owner's writes), built of the reads owner and readers share
(`store_reader`), its layout and exceptions (`layout`), its named segment (`segment`, named
and reclaimed by `segment_names`), where its pages are placed and how peers open them
(`placement`; on CUDA through `cuda_ipc`), its free lists (`page_pool`) and its validated
copies (`validated_copy`), and the chain digests that say what each page holds (`digests`);
`staging` moves pages between a device store and the host store below it.

Below it, the disk tier (`disk_tier`): verified page records in one file of fixed slots
(`disk_records` the bytes, `disk_file` the files and lock, `disk_index` the slot and
eviction tables, `disk_adopt` verification at open, `disk_rate` the read-rate estimate)."""
