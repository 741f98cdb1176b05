"""The one guard on where kvmesh listens: never on every interface.

The service and the page servers bind to this node's own address or to loopback. A
wildcard bind would put the index and the KV pages on every network the machine is on,
so every spelling of "any address" is refused where a host is configured.
"""

from __future__ import annotations

import ipaddress
import socket

# Wildcards that are not IP literals: ZMQ's "*", an empty host, and names some tools
# resolve to the unspecified address.
_WILDCARD_NAMES = frozenset(("", "*", "any", "inaddr_any", "in6addr_any"))


def is_every_interface(host: str) -> bool:
    """Whether binding `host` would listen on every interface: any spelling of 0.0.0.0 or
    :: (IPv4 in every form the kernel's inet_aton takes, such as "0", "0x0" or
    "000.000.000.000"; IPv6 with or without brackets or a zone; IPv4-mapped), the
    wildcard names, or a host name that resolves to one of those."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):  # a bracketed IPv6 literal
        name = name[1:-1]
    if name in _WILDCARD_NAMES:
        return True
    name = name.split("%", 1)[0]  # an IPv6 zone ("::%eth0") does not narrow a wildcard
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        mapped = getattr(address, "ipv4_mapped", None)
        return address.is_unspecified or bool(mapped and mapped.is_unspecified)
    try:  # the forms ip_address refuses but the kernel binds: "0", "0x0", "0.0", octal
        return socket.inet_aton(name) == bytes(4)
    except OSError:
        pass
    return _resolves_to_every_interface(name)


def _resolves_to_every_interface(name: str) -> bool:
    try:
        resolved = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):  # unresolvable: it cannot be bound either
        return False
    return any(is_every_interface(str(entry[4][0])) for entry in resolved)


def check_bind_host(host: str, what: str = "host") -> str:
    """`host`, unless it would listen on every interface.

    Args:
        host: the configured host: an address of this node, loopback, or a name such as
            "loopback" / "node" that the caller resolves later.
        what: how the caller names the setting in its error (e.g. "service.host").

    Returns:
        `host`, unchanged.

    Raises:
        ValueError: `host` is not a str, or is a wildcard.
    """
    if not isinstance(host, str):
        raise ValueError(f"{what} must be a str, got {type(host).__name__}")
    if is_every_interface(host):
        raise ValueError(
            f"{what} {host!r} would listen on every interface; give this node's address "
            "or 127.0.0.1"
        )
    return host
