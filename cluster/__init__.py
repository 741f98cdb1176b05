"""Launching kvmesh on Ray, the typed configuration and the `kvmesh` command line."""
