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

A deployment of N replicas with one configuration (a Ray Serve LLM app) shares a token
for N engines, which carries N under the HMAC:

    token = urlsafe_b64(nonce (16 bytes) || N (4 bytes, big-endian) || HMAC(key, nonce || N)[:16])

The first N engine ids that enroll with it are bound to it, and no other.
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
_COUNT_BYTES = 4
TOKEN_CHARS = 44  # base64 of 32 bytes: a token for one engine
SHARED_TOKEN_CHARS = 48  # base64 of 36 bytes: a token for N engines
MAX_ENGINES = 1024  # the most engines one token may enroll


class BadToken(ValueError):
    """A token that is not one this mesh's enrollment key issued."""


def new_key() -> bytes:
    """A fresh enrollment key (kept by the operator; the service checks tokens with it)."""
    return secrets.token_bytes(KEY_BYTES)


def issue(key: bytes, engines: int = 1) -> str:
    """A new enrollment token under `key`, for one engine or for `engines` of them.

    Raises:
        ValueError: `engines` is not 1..MAX_ENGINES.
    """
    if not isinstance(engines, int) or not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"a token enrolls 1 to {MAX_ENGINES} engines, got {engines!r}")
    signed = secrets.token_bytes(_NONCE_BYTES)
    if engines > 1:
        signed += engines.to_bytes(_COUNT_BYTES, "big")
    return base64.urlsafe_b64encode(signed + _mac(key, signed)).decode("ascii")


def check(key: bytes, token: object) -> tuple[bytes, int]:
    """The digest that names `token` once it is spent (never the token itself), and how
    many engines it enrolls.

    Raises:
        BadToken: `token` is not a str of TOKEN_CHARS (or SHARED_TOKEN_CHARS) chars that
            `key` issued.
    """
    if not isinstance(token, str) or len(token) not in (TOKEN_CHARS, SHARED_TOKEN_CHARS):
        raise BadToken(
            f"an enrollment token is a {TOKEN_CHARS}-char string "
            f"({SHARED_TOKEN_CHARS} for several engines)"
        )
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError):
        raise BadToken("an enrollment token is base64 (urlsafe)") from None
    signed, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, signed)):  # constant time
        raise BadToken("this enrollment token was not issued for this mesh")
    engines = int.from_bytes(signed[_NONCE_BYTES:], "big") if len(signed) > _NONCE_BYTES else 1
    if not 1 <= engines <= MAX_ENGINES:  # only a key that issued it could sign it so
        raise BadToken(f"this enrollment token names {engines} engines")
    return hashlib.sha256(raw).digest(), engines


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()[:_MAC_BYTES]
