"""CurveZMQ public keys on the wire: 32 raw bytes, where the mesh hands keys out in z85.

Z85 (ZeroMQ RFC 32) writes each 4 bytes, read as a big-endian uint32, as 5 digits of base
85 over a fixed alphabet, most significant first. It is done here rather than with
pyzmq's helper so the codec stays below ZMQ (the codec imports no transport).
"""

from __future__ import annotations

import struct

KEY_BYTES = 32  # a CurveZMQ public key
Z85_KEY_CHARS = 40  # the same key in z85, as `cache_service.auth.KeyPair` holds it

_ALPHABET = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_DIGITS = {char: value for value, char in enumerate(_ALPHABET)}
_WORDS = struct.Struct(">8I")  # a key is 8 words
assert len(_ALPHABET) == 85


def z85_key(raw: bytes) -> bytes:
    """A 32-byte key in z85 (40 bytes)."""
    assert len(raw) == KEY_BYTES, f"a key is {KEY_BYTES} bytes, got {len(raw)}"
    out = bytearray()
    for word in _WORDS.unpack(raw):
        digits = bytearray(5)
        for at in range(4, -1, -1):
            word, digit = divmod(word, 85)
            digits[at] = _ALPHABET[digit]
        out += digits
    return bytes(out)


def raw_key(z85: bytes) -> bytes | None:
    """A z85 key (40 bytes) as its 32 raw bytes; None when it is not one."""
    if len(z85) != Z85_KEY_CHARS:
        return None
    words = []
    for start in range(0, Z85_KEY_CHARS, 5):
        word = 0
        for char in z85[start : start + 5]:
            digit = _DIGITS.get(char)
            if digit is None:
                return None
            word = word * 85 + digit
        if word > 0xFFFFFFFF:  # five z85 digits reach past a uint32
            return None
        words.append(word)
    return _WORDS.pack(*words)
