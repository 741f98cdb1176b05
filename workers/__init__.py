"""Worker side of kvmesh: page store, local prefix cache, client, transfer, model runner."""
