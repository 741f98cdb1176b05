"""The one guard on where kvmesh listens: never on every interface.

The service and the page servers bind to this node's own address or to loopback. A
wildcard bind would put the index and the KV pages on every network the machine is on,
so every spelling of "any address" is refused where a host is configured.
"""

from __future__ import annotations

import ipaddress

# Wildcards that are not IP literals: ZMQ's "*", an empty host, and names some tools
# resolve to the unspecified address.
_WILDCARD_NAMES = frozenset(("", "*", "any", "inaddr_any", "in6addr_any"))


def is_every_interface(host: str) -> bool:
    """Whether binding `host` would listen on every interface (0.0.0.0, ::, *, ...)."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):  # a bracketed IPv6 literal
        name = name[1:-1]
    if name in _WILDCARD_NAMES:
        return True
    name = name.split("%", 1)[0]  # an IPv6 zone ("::%eth0") does not narrow a wildcard
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        pass
    # inet_aton spellings of 0.0.0.0 ("0", "0.0", "000.0.0.0") that ip_address refuses.
    parts = name.split(".")
    return 1 <= len(parts) <= 4 and all(part.isdigit() and int(part) == 0 for part in parts)


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
