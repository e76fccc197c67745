"""The islands' wire: a round's contribution as one sealed record, and the shared secret that authenticates it.

Where a round gathers every island's contribution (an ``aggregate`` that
declares its encoding, :func:`jaxopt_dist._src.base.wire_of`, or any merge under
a shared secret), each island sends one record, of one length on every island::

    header (HEADER.size bytes) | payload (the message's arrays, raw, in order) | zero padding | tag (32 bytes)

The header (little-endian) holds a magic, the island's id, its round, the
fragment (-1: a join), flags (healed in this round; abstains), its weight, its
anchor's tag, the round its process joined in, its nonce, its settings, a tag of
the payload's layout (its arrays' dtypes and shapes) and the payload's length.
The tag is HMAC-SHA256 under the islands' shared secret over the header and the
payload, so over the round, the island id, the fragment and the payload; 32 zero
bytes without a secret. Every record is padded to the longest fragment's, so
that an island that does not know the round's fragment (one whose heal was
refused) still sends a record of the right length.

:func:`open_record` reads a peer's record against the receiver's own layouts and
refuses it (:class:`Rejected`, with the reason) when it is not a record, when its
tag fails (with a secret: missing or wrong), when its header gives a layout or a
payload length that is not the fragment's, or when its padding is not zeros.
Nothing in a record is ever evaluated: the payload is read as the arrays the
receiver's own layout says.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"JDWIRE1\n"
HEADER = struct.Struct("<8sIIiIfIII8IIQ")
"""magic, island, round, fragment, flags, weight, anchor, joined, nonce, settings[8], layout, payload bytes."""
TAG_BYTES = 32
MIN_SECRET_BYTES = 16
_NO_TAG = bytes(TAG_BYTES)
_HEALED, _ABSTAINS = 1, 2


def tag(secret: bytes | None, domain: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``secret``, for ``domain`` (what is tagged); 32 zero bytes without one."""
    if secret is None:
        return _NO_TAG
    mac = hmac.new(secret, domain + b"\0", hashlib.sha256)
    for p in parts:
        mac.update(p)
    return mac.digest()


def tag_problem(secret: bytes | None, got: bytes, want: bytes) -> str | None:
    """Why a received tag ``got`` fails (``want``: the one under this island's ``secret``), or None."""
    if secret is None or hmac.compare_digest(got, want):
        return None
    if got == _NO_TAG:
        return "it carries no tag (its sender holds no secret)"
    return "its tag is wrong (its sender holds another secret, or the bytes were changed)"


def check_secret(secret: Any) -> bytes | None:
    """``secret`` as bytes (None: no secret); a ``ValueError`` unless it has at least 16 bytes."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"`secret` must be bytes (or a str) of at least {MIN_SECRET_BYTES} bytes, the same on every "
            f"island (e.g. `head -c 32 /dev/urandom > secret`); got {type(secret).__name__} of "
            f"{len(secret) if isinstance(secret, (bytes, bytearray)) else 'no'} bytes."
        )
    return bytes(secret)


def read_secret(path: str) -> bytes:
    """The shared secret in the file ``path`` (its bytes, without a trailing newline), checked."""
    if not os.path.isfile(path):
        raise ValueError(f"the secret file {path!r} does not exist")
    with open(path, "rb") as f:
        secret = f.read().rstrip(b"\r\n")
    try:
        return check_secret(secret) or b""
    except ValueError as e:
        raise ValueError(f"the secret file {path!r}: {e}") from None


class Layout(NamedTuple):
    """The arrays of a fragment's message: ``(dtype name, shape)`` each, in order."""

    specs: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, arrays: Sequence[Any]) -> Layout:
        return cls(tuple((np.dtype(a.dtype).name, tuple(int(n) for n in a.shape)) for a in arrays))

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * _dtype(d).itemsize for d, s in self.specs)

    @property
    def tag(self) -> int:
        """32 bits of the SHA-256 of the layout, for the header."""
        return int(hashlib.sha256(repr(self.specs).encode()).hexdigest()[:8], 16)

    def split(self, payload: memoryview) -> list[np.ndarray]:
        """The message's arrays read from ``payload`` (copies, in this layout)."""
        out, start = [], 0
        for d, s in self.specs:
            dtype = _dtype(d)
            n = int(np.prod(s, dtype=np.int64)) * dtype.itemsize
            out.append(np.frombuffer(payload[start : start + n], np.uint8).view(dtype).reshape(s).copy())
            start += n
        return out


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # knows bfloat16 and the other ml_dtypes by name

    return np.dtype(jnp.dtype(name))


class Header(NamedTuple):
    """What a record says of its island's contribution (see the module)."""

    island: int
    round: int
    fragment: int
    weight: float
    anchor: int
    joined: int
    nonce: int
    settings: tuple[int, ...]
    healed: bool = False
    abstains: bool = False
    layout: int = 0
    payload: int = 0


def record_size(layouts: Sequence[Layout]) -> int:
    """The length of every record of a run whose fragments' messages have ``layouts``."""
    return HEADER.size + max([x.nbytes for x in layouts] + [0]) + TAG_BYTES


def seal(h: Header, message: Sequence[np.ndarray], *, size: int, secret: bytes | None) -> np.ndarray:
    """The record of ``h`` and ``message`` (its arrays' raw bytes), ``size`` bytes, tagged under ``secret``."""
    payload = b"".join(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes() for a in message)
    if h.weight == 0 and payload:
        raise ValueError("a contribution of weight 0 carries no payload")
    settings = tuple(int(v) for v in h.settings) + (0,) * (8 - len(h.settings))
    flags = (_HEALED if h.healed else 0) | (_ABSTAINS if h.abstains else 0)
    head = HEADER.pack(
        MAGIC, h.island, h.round, h.fragment, flags, h.weight, h.anchor, h.joined, h.nonce, *settings,
        h.layout, len(payload),
    )  # fmt: skip
    if HEADER.size + len(payload) + TAG_BYTES > size:
        raise ValueError(f"a record of {size} bytes cannot hold a payload of {len(payload)} bytes")
    out = np.zeros(size, np.uint8)
    out[: HEADER.size] = np.frombuffer(head, np.uint8)
    out[HEADER.size : HEADER.size + len(payload)] = np.frombuffer(payload, np.uint8)
    out[size - TAG_BYTES :] = np.frombuffer(tag(secret, b"contribution", head, payload), np.uint8)
    return out


class Opened(NamedTuple):
    """A peer's record that passed every check: its header and its message's arrays."""

    header: Header
    message: list[np.ndarray]


class Rejected(NamedTuple):
    """A peer's record that did not: the island it claims to come from (None if unreadable) and why."""

    island: int | None
    reason: str

    @property
    def unauthenticated(self) -> bool:
        """Whether it was refused for its tag."""
        return self.reason.startswith("it carries no tag") or self.reason.startswith("its tag is wrong")


def open_record(record: np.ndarray, *, layouts: dict[int, Layout], secret: bytes | None) -> Opened | Rejected:
    """A peer's record read against this island's ``layouts`` (per fragment; -1 a join, with no payload)."""
    raw = memoryview(np.ascontiguousarray(record, np.uint8)).cast("B")
    size = record_size(list(layouts.values()))
    if len(raw) != size:
        return Rejected(None, f"a record of {len(raw)} bytes, where this run's are {size}")
    fields = HEADER.unpack(raw[: HEADER.size])
    magic, island, round_, fragment, flags, weight, anchor, joined, nonce = fields[:9]
    settings, layout, n = tuple(fields[9:17]), fields[17], fields[18]
    if magic != MAGIC:
        return Rejected(None, f"it is not a contribution: it starts with {bytes(magic)!r}, not {MAGIC!r}")
    capacity = size - HEADER.size - TAG_BYTES
    if n > capacity:
        return Rejected(
            island, f"its header gives a payload of {n} bytes, more than a record holds ({capacity})"
        )
    problem = tag_problem(
        secret,
        bytes(raw[size - TAG_BYTES :]),
        tag(secret, b"contribution", raw[: HEADER.size], raw[HEADER.size : HEADER.size + n]),
    )
    if problem is not None:
        return Rejected(island, problem)
    abstains = bool(flags & _ABSTAINS)
    if fragment not in layouts and not abstains:
        return Rejected(island, f"it is for fragment {fragment}, which this run does not have")
    want = Layout(()) if weight == 0 else layouts[fragment]  # a contribution of weight 0 carries nothing
    if n != want.nbytes:
        return Rejected(
            island,
            f"its header gives a payload of {n} bytes; fragment {fragment}'s encoding is {want.nbytes} bytes",
        )
    if layout != want.tag:
        return Rejected(
            island, f"its payload is laid out otherwise than fragment {fragment}'s here (another aggregate?)"
        )
    if np.frombuffer(raw[HEADER.size + n : size - TAG_BYTES], np.uint8).any():
        return Rejected(island, "its padding is not zeros")
    header = Header(
        island,
        round_,
        fragment,
        float(weight),
        anchor,
        joined,
        nonce,
        settings,
        bool(flags & _HEALED),
        abstains,
        layout,
        n,
    )
    return Opened(header, want.split(raw[HEADER.size : HEADER.size + n]))
