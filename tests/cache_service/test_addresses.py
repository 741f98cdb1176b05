"""The one guard on where kvmesh listens, and that every listener goes through it."""

from __future__ import annotations

import re

import pytest

from cache_service.addresses import check_bind_host, is_every_interface
from cache_service.server import ServerConfig
from cluster.config import ConfigError, config_from_dict
from workers.transfer import PageServer

WILDCARDS = [
    "*",
    "",
    " ",
    "0.0.0.0",
    "0",
    "0.0",
    "000.0.0.0",
    "::",
    "[::]",
    "::0",
    "0::0",
    "0:0:0:0:0:0:0:0",
    "::%eth0",
    "ANY",
    "inaddr_any",
]
HOSTS = [
    "127.0.0.1",
    "10.0.0.5",
    "::1",
    "[::1]",
    "fe80::1%eth0",
    "loopback",
    "node",
    "worker-3.cluster.local",
    "0.0.0.1",
    "00001.0.0.0",
]


@pytest.mark.parametrize("host", WILDCARDS)
def test_every_spelling_of_every_interface_is_refused(host):
    assert is_every_interface(host)
    with pytest.raises(ValueError, match=re.escape(f"{host!r} would listen on every interface")):
        check_bind_host(host)


@pytest.mark.parametrize("host", HOSTS)
def test_node_addresses_and_names_pass(host):
    assert not is_every_interface(host)
    assert check_bind_host(host) == host


def test_a_host_must_be_a_str():
    with pytest.raises(ValueError, match="service.host must be a str, got int"):
        check_bind_host(0, "service.host")  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "*"])
def test_every_listener_uses_the_guard(host):
    with pytest.raises(ValueError, match="every interface"):
        ServerConfig(host=host)
    for section in ("service", "workers"):
        with pytest.raises(ConfigError, match=f"{section}.host .* every interface"):
            config_from_dict({section: {"host": host}})
    with pytest.raises(ValueError, match="page server host .* every interface"):
        PageServer(store=None, host=host)  # type: ignore[arg-type]
