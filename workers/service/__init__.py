"""A worker's side of the service: the ZMQ client (`client`), the publisher of its events
and heartbeats (`publisher`) and the figures its heartbeats carry (`figures`)."""
