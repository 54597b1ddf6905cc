"""Compact byte encodings for the token ids and log-probs the store keeps.

A 6-turn rollout holds thousands of token ids; as JSON lists they would be several times
larger and slower to read back. Ids are stored as little-endian int32 and log-probs as
little-endian float32, so a row is 4 bytes per token per column.
"""

from __future__ import annotations

import sys
from array import array

__all__ = ["pack_floats", "pack_ids", "unpack_floats", "unpack_ids"]

# Little-endian on disk so a store file moves between machines unchanged.
_SWAP = sys.byteorder != "little"


def _pack(typecode: str, values: list[int] | list[float]) -> bytes:
    arr = array(typecode, values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def _unpack(typecode: str, data: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as int32 bytes; raises OverflowError for an id outside int32."""
    return _pack("i", ids)


def unpack_ids(data: bytes) -> list[int]:
    """Inverse of pack_ids."""
    return _unpack("i", data).tolist()


def pack_floats(values: list[float]) -> bytes:
    """Log-probs as float32 bytes (float32 is what engines sample in; nothing is lost)."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    """Inverse of pack_floats; values come back as the nearest float32."""
    return _unpack("f", data).tolist()
