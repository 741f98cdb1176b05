"""Every spelling of "every interface" is refused where kvmesh listens.

Finding covered: the guard refused `*`, `0.0.0.0` and `::` but accepted `0`, `0x0` and
`000.000.000.000`, which the kernel binds as every interface.
"""

from __future__ import annotations

import socket

import pytest

from cache_service.addresses import check_bind_host, is_every_interface
from cache_service.server import ServerConfig

SPELLINGS = [
    "0",
    "0x0",
    "0X00000000",
    "00",
    "0.0",
    "0.0.0",
    "000.000.000.000",
    "0x0.0x0.0x0.0x0",
    "0.0x0.00.0",
    "::ffff:0.0.0.0",
    "[::ffff:0.0.0.0]",
    "0:0::0",
    "::0.0.0.0",
]


@pytest.mark.parametrize("host", SPELLINGS)
def test_every_spelling_the_kernel_takes_for_any_address_is_refused(host):
    assert is_every_interface(host)
    with pytest.raises(ValueError, match="every interface"):
        ServerConfig(host=host)


@pytest.mark.parametrize("host", ["0x0", "000.000.000.000", "0"])
def test_the_kernel_really_binds_them_to_every_interface(host):
    """The reason for the guard, checked against the kernel: these are INADDR_ANY."""
    assert socket.inet_aton(host) == b"\x00\x00\x00\x00"


def test_a_hostname_that_resolves_to_any_address_is_refused(monkeypatch):
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "everywhere.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("0.0.0.0", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(ValueError, match="'everywhere.example' .*every interface"):
        check_bind_host("everywhere.example")
    assert check_bind_host("localhost") == "localhost"  # resolves to loopback only


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.5", "0.0.0.1", "::1", "localhost"])
def test_real_addresses_pass(host):
    assert check_bind_host(host) == host
