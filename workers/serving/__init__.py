"""Serving requests on a worker: sequences, the scheduler, the batch runner, the serving
loop, sampling, the models and their loader, request checks, and KV compaction."""
