"""The central kvmesh service: global prefix index, wire protocol, server, Ray actor."""
