"""Enrollment tokens: the operator's say-so for one engine to join the mesh.

An engine joins through Ray (`ServiceActor.enroll`), and anyone who reaches the service
actor could ask. So the actor admits an engine only with a token the operator issued: a
random nonce and its HMAC under the mesh's enrollment key, which `kvmesh up` keeps in a
file only its user reads and never hands to the actor's callers. Issuing needs the key,
not Ray (`kvmesh enroll-token`); checking needs no list of what was issued:

    token = urlsafe_b64(nonce (16 bytes) || HMAC-SHA256(key, nonce)[:16])

A token is spent by the first engine id that enrolls with it: the service binds the two,
so the same engine may enroll again with it (its scheduler and worker processes both do,
and so does a restarted engine), and no other id can.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

KEY_BYTES = 32
_NONCE_BYTES = 16
_MAC_BYTES = 16
TOKEN_CHARS = 44  # base64 of 32 bytes


class BadToken(ValueError):
    """A token that is not one this mesh's enrollment key issued."""


def new_key() -> bytes:
    """A fresh enrollment key (kept by the operator; the service checks tokens with it)."""
    return secrets.token_bytes(KEY_BYTES)


def issue(key: bytes) -> str:
    """A new one-time enrollment token under `key`."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return base64.urlsafe_b64encode(nonce + _mac(key, nonce)).decode("ascii")


def check(key: bytes, token: object) -> bytes:
    """The digest that names `token` once it is spent (never the token itself).

    Raises:
        BadToken: `token` is not a str of TOKEN_CHARS chars that `key` issued.
    """
    if not isinstance(token, str) or len(token) != TOKEN_CHARS:
        raise BadToken(f"an enrollment token is a {TOKEN_CHARS}-char string")
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError):
        raise BadToken("an enrollment token is base64 (urlsafe)") from None
    nonce, mac = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, nonce)):  # constant time
        raise BadToken("this enrollment token was not issued for this mesh")
    return hashlib.sha256(raw).digest()


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()[:_MAC_BYTES]
