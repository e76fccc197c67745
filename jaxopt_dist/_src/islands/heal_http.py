"""Healing that runs nothing from the network: a tensor-only stream over HTTP, checked on arrival.

torchft's checkpoint transport plays this part for torch: its ``HTTPTransport``
pickles the state it sends and unpickles what it receives (``weights_only=False``:
a healing source can run code in the island it heals), serves on every interface
and advertises the host's name. Here a healing state (nested dicts and lists of
arrays and plain numbers, strings or None) crosses as::

    MAGIC | header length (8 bytes, little-endian) | JSON header | tag (32 bytes) | each array's raw bytes

The header names the source island and the step, gives the tree's shape and, for
each array in order, its path in the tree, dtype, shape, byte length and SHA-256.
The tag is HMAC-SHA256 under the islands' shared secret over the header (and so
over every array's digest); 32 zero bytes without a secret. A receiver checks, in
this order, and refuses the state at the first failure (:class:`HealRefused`,
naming the source and the reason), before any of it is used: the magic, the
header's size, the tag (when it holds a secret), the header's form,
:attr:`Expected.first` (an island: the source's settings), the arrays against
its own (:class:`Expected`: paths, dtypes and shapes), each array's digest
(its bytes read in chunks into arrays allocated from the header and hashed
as they arrive, in a thread beside the reads), then :attr:`Expected.verify`
(an island: its anchor's digest against the one its source's round agreed
on). Nothing received is ever unpickled or evaluated, on either side.

:class:`HealServer` listens on one address (the island's) and serves one staged
state, under the step it was staged for, streamed in chunks; :func:`fetch` reads
one within a deadline (the heal's own timeout, not the exchange's).
:func:`stage` and :func:`read` are the format alone (an in-process transport
uses them without HTTP).
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import queue
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from jaxopt_dist._src.islands.transport import ExchangeError, HealRefused
from jaxopt_dist._src.islands.wire import tag, tag_problem

MAGIC = b"JDHEAL2\n"
FORMAT = "jaxopt_dist heal 2"
TAG_BYTES = 32
MAX_HEADER = 64 * 2**20
CHUNK = 2**20


class Expected(NamedTuple):
    """What a healing island accepts: its own arrays, in order, and a last check of the whole.

    Attributes:
      arrays: ``(path, dtype name, shape)`` of every array of the island's
        part of the state, in the order they are served.
      prefix: the path of the island's part in the served tree (``"user/default/"``
        under torchft's ``Manager``, which wraps it); no array lies elsewhere.
      verify: called with the island's part once every array has arrived and
        matched its digest; raises ``ValueError`` saying why it refuses it.
      first: called with the island's part before any array is read or
        compared (its plain values, None in place of each array): e.g. the
        source's settings, which may refuse the island itself (an error
        other than ``ValueError`` passes through unchanged).
    """

    arrays: list[tuple[str, str, tuple[int, ...]]]
    prefix: str = ""
    verify: Callable[[Any], None] | None = None
    first: Callable[[Any], None] | None = None


class Staged(NamedTuple):
    """A state encoded to be served: its step, header, tag and arrays."""

    step: int
    header: bytes
    tag: bytes
    arrays: list[np.ndarray]

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The stream: the magic, the header's length, the header, the tag, then each array in chunks."""
        yield MAGIC + struct.pack("<Q", len(self.header)) + self.header + self.tag
        for a in self.arrays:
            view = _bytes(a)
            for start in range(0, len(view), CHUNK):
                yield view[start : start + CHUNK]

    @property
    def size(self) -> int:
        return len(MAGIC) + 8 + len(self.header) + TAG_BYTES + sum(a.nbytes for a in self.arrays)


def stage(tree: Any, *, step: int, source: int | None = None, secret: bytes | None = None) -> Staged:
    """``tree`` as the stream a healing server sends: its header (with every array's SHA-256) and tag."""
    arrays: list[np.ndarray] = []
    paths: list[str] = []
    skeleton = _skeleton(tree, arrays, paths, "")
    specs = [
        {
            "path": p,
            "dtype": a.dtype.name,
            "shape": list(a.shape),
            "bytes": int(a.nbytes),
            "sha256": hashlib.sha256(_bytes(a)).hexdigest(),
        }
        for p, a in zip(paths, arrays)
    ]
    header = json.dumps(
        {"format": FORMAT, "source": source, "step": int(step), "tree": skeleton, "arrays": specs}
    ).encode()
    return Staged(int(step), header, tag(secret, b"heal", header), arrays)


def _skeleton(x: Any, arrays: list[np.ndarray], paths: list[str], path: str) -> Any:
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError("a healing state's dict keys must be strings")
        return {"d": {k: _skeleton(v, arrays, paths, f"{path}{k}/") for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return {"l": [_skeleton(v, arrays, paths, f"{path}{i}/") for i, v in enumerate(x)]}
    if x is None or (isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic)):
        return {"v": x}
    a = np.asarray(x)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        a = a.copy(order="C")
    if a.dtype.hasobject:
        raise TypeError(f"a healing state holds arrays of numbers only; got dtype {a.dtype}")
    arrays.append(a)
    paths.append(path.rstrip("/"))
    return {"a": len(arrays) - 1}


def _rebuild(skeleton: Any, arrays: list[Any]) -> Any:
    ((kind, body),) = skeleton.items()
    if kind == "d":
        return {str(k): _rebuild(v, arrays) for k, v in body.items()}
    if kind == "l":
        return [_rebuild(v, arrays) for v in body]
    if kind == "a":
        return arrays[int(body)]
    if kind == "v":
        if body is not None and not isinstance(body, (bool, int, float, str)):
            raise ValueError(f"a plain value may not be {type(body).__name__}")
        return body
    raise ValueError(f"unknown node {kind!r}")


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # knows bfloat16 and the other ml_dtypes by name

    dtype = np.dtype(jnp.dtype(name))
    if dtype.hasobject:
        raise ValueError(f"arrays of {name}")
    return dtype


def _bytes(a: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, writable where the array is (any dtype, bfloat16 included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


class _Stream(NamedTuple):
    """Where a state's bytes come from: ``readinto(view) -> n`` (0 at the end), within ``deadline``."""

    readinto: Callable[[memoryview], int]
    deadline: float | None = None
    before_read: Callable[[float], None] | None = None  # (seconds left): e.g. a socket's timeout


def read(
    stream: Any,
    *,
    where: str,
    secret: bytes | None = None,
    expect: Expected | None = None,
    limit: int | None = None,
    deadline: float | None = None,
) -> Any:
    """A healing state from ``stream`` (anything with ``readinto``), checked (see the module).

    Raises :class:`HealRefused` (its message names ``where`` and the reason) at the first check that fails.
    """
    return _read(_Stream(stream.readinto, deadline), where, secret, expect, limit)


def _read(src: _Stream, where: str, secret: bytes | None, expect: Expected | None, limit: int | None) -> Any:
    source: int | None = None  # the serving island, once its header names it

    def refuse(reason: str) -> HealRefused:
        return HealRefused(f"the healing state from {where} is refused: {reason}", source)

    def take(n: int, what: str) -> bytes:
        buf = bytearray(n)
        got = _fill(memoryview(buf), src)
        if got < n:
            raise refuse(f"the stream ended after {got} of the {n} bytes of {what}")
        return bytes(buf)

    magic = take(len(MAGIC), "its first bytes")
    if magic != MAGIC:
        kind = " (a pickle)" if magic[:1] == b"\x80" else ""
        raise refuse(f"it is not a healing state: it starts with {magic!r}{kind}, not {MAGIC!r}")
    (n_header,) = struct.unpack("<Q", take(8, "the header's length"))
    if n_header > MAX_HEADER:
        raise refuse(f"its header would be {n_header} bytes (at most {MAX_HEADER})")
    header_bytes = take(n_header, "the header")
    problem = tag_problem(secret, take(TAG_BYTES, "the tag"), tag(secret, b"heal", header_bytes))
    if problem is not None:
        source = _claimed_source(header_bytes)  # unauthenticated: named, never trusted
        raise refuse(problem)
    try:
        header = json.loads(header_bytes)
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, not {FORMAT!r}")
        specs = [_spec(s) for s in header["arrays"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise refuse(f"its header is malformed: {e}") from e
    source = _claimed_source(header_bytes)
    if source is not None:
        where = f"{where} (island {source})"
    if expect is not None and expect.first is not None:
        try:
            expect.first(_part(_rebuild(header["tree"], [None] * len(specs)), expect.prefix))
        except (RecursionError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise refuse(str(e)) from e
    if expect is not None:
        mismatch = _mismatch([(p, d.name, s) for p, d, s, _ in specs], expect)
        if mismatch:
            raise refuse(mismatch)
    total = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, d, s, _ in specs)
    if limit is not None and total > limit:
        raise refuse(f"it offers {total} bytes of arrays; at most {limit} are expected")
    arrays, hashes = [], []
    with _Hasher() as hasher:  # each chunk hashed in a thread beside the next chunk's read
        for path, dtype, shape, _ in specs:
            a = np.empty(shape, dtype)
            hashes.append(hashlib.sha256())
            got = _fill(_bytes(a), src, hasher.feeding(hashes[-1]))
            if got < a.nbytes:
                raise refuse(f"the stream ended after {got} of the {a.nbytes} bytes of array {path!r}")
            arrays.append(a)
    for (path, _, _, digest), h in zip(specs, hashes):
        if h.hexdigest() != digest:
            raise refuse(f"array {path!r} does not match its SHA-256 in the header (corrupted on the way)")
    try:
        tree = _rebuild(header["tree"], arrays)
        if expect is not None and expect.verify is not None:
            expect.verify(_part(tree, expect.prefix))
    except (RecursionError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise refuse(str(e)) from e
    return tree


def _claimed_source(header: bytes) -> int | None:
    """The island a header says it comes from (None where it does not say, or is not JSON)."""
    try:
        source = json.loads(header).get("source")
    except (ValueError, AttributeError, RecursionError):
        return None
    return source if isinstance(source, int) and not isinstance(source, bool) else None


def _spec(s: Any) -> tuple[str, np.dtype, tuple[int, ...], str]:
    dtype = _dtype(str(s["dtype"]))
    shape = tuple(int(n) for n in s["shape"])
    if any(n < 0 for n in shape) or int(s["bytes"]) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"array {s['path']!r}: {s['bytes']} bytes for shape {shape} of {dtype.name}")
    return str(s["path"]), dtype, shape, str(s["sha256"])


def _mismatch(got: list[tuple[str, str, tuple[int, ...]]], expect: Expected) -> str | None:
    """How the served arrays differ from the island's own (``expect``), in words, or None."""
    want = [(expect.prefix + p, d, tuple(s)) for p, d, s in expect.arrays]
    if got == want:
        return None
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (
                f"it does not fit this island's state: array {i} is {g[0]!r} {g[1]}{list(g[2])} there, "
                f"{w[0]!r} {w[1]}{list(w[2])} here"
            )
    return f"it does not fit this island's state: {len(got)} arrays there, {len(want)} here"


def _part(tree: Any, prefix: str) -> Any:
    for key in [k for k in prefix.split("/") if k]:
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


class _Feed(NamedTuple):
    h: Any
    queue: queue.SimpleQueue

    def update(self, chunk: memoryview) -> None:
        self.queue.put((self.h, chunk))


class _Hasher:
    """SHA-256 updates run in a thread of their own (hashlib releases the GIL on large buffers), so that
    hashing one chunk overlaps reading the next; leaving the ``with`` block waits for every update."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="island-heal-hash", daemon=True)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            item[0].update(item[1])

    def feeding(self, h: Any) -> _Feed:
        """An object whose ``update(chunk)`` hands ``chunk`` to ``h`` in the thread."""
        return _Feed(h, self._queue)

    def __enter__(self) -> _Hasher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._queue.put(None)
        self._thread.join()


def _fill(view: memoryview, src: _Stream, h: Any = None) -> int:
    """Reads into ``view`` in chunks until it is full or the stream ends; the bytes read (and hashed)."""
    done = 0
    while done < len(view):
        if src.deadline is not None:
            left = src.deadline - time.monotonic()
            if left <= 0:
                raise ExchangeError("the heal did not finish within its timeout")
            if src.before_read is not None:
                src.before_read(left)
        n = src.readinto(view[done : done + CHUNK])
        if not n:
            break
        if h is not None:
            h.update(view[done : done + n])
        done += n
    return done


class HealServer:
    """Serves one staged healing state over HTTP on ``host`` (``GET /heal/<step>``), streamed in chunks.

    Args:
      host: the address to listen on (the island's); port 0 picks a free one.
      source: the serving island's id, written into the header.
      secret: the islands' shared secret (the header's tag), or None.
      send_timeout: seconds a send to a stalled peer may block before the
        connection is dropped, and a request for a step not staged yet waits.
    """

    def __init__(
        self,
        host: str,
        *,
        port: int = 0,
        source: int | None = None,
        secret: bytes | None = None,
        send_timeout: float = 60.0,
    ):
        self.source, self.secret = source, secret
        self._lock = threading.Condition()
        self._wait = send_timeout
        self._staged: Staged | None = None
        self.sent = 0  # bytes written to peers
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._http = _Server((host, port), _handler(self, send_timeout), family)
        self.host, self.port = host, int(self._http.server_address[1])
        self._thread = threading.Thread(target=self._http.serve_forever, name="island-heal", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The address peers fetch from, the step appended."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/heal/"

    def stage(self, step: int, tree: Any) -> None:
        """Serves ``tree`` to peers that ask for ``step``, until the next stage."""
        staged = stage(tree, step=step, source=self.source, secret=self.secret)
        with self._lock:
            self._staged = staged
            self._lock.notify_all()

    def staged(self, step: int) -> Staged | None:
        """The state staged for ``step``; a request for a step not staged yet waits (a peer may ask
        before this island's quorum has staged it) up to the send timeout; None for an older step."""
        with self._lock:
            ready = lambda: self._staged is not None and self._staged.step >= step  # noqa: E731
            self._lock.wait_for(ready, timeout=self._wait)
            if self._staged is None or self._staged.step != step:
                return None  # not staged in time, or an older step than the one staged
            return self._staged

    def response(self, step: int) -> tuple[int, Iterator[bytes | memoryview]] | None:
        """What a request for ``step`` gets: ``(length, chunks)``, or None (404)."""
        staged = self.staged(step)
        return None if staged is None else (staged.size, staged.chunks())

    def count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, family: socket.AddressFamily):
        self.address_family = family
        super().__init__(address, handler)


def _handler(server: HealServer, send_timeout: float) -> Any:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = send_timeout

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            parts = self.path.strip("/").split("/")
            step = int(parts[1]) if len(parts) == 2 and parts[0] == "heal" and parts[1].isdigit() else -1
            answer = server.response(step) if step >= 0 else None
            if answer is None:
                self.send_error(404, f"no healing state for {self.path}")
                return
            size, chunks = answer
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(chunk)
                server.count(len(chunk))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            del format, args

    return Handler


def fetch(
    url: str,
    *,
    deadline: float,
    secret: bytes | None = None,
    expect: Expected | None = None,
    limit: int | None = None,
) -> Any:
    """The healing state at ``url``, read and checked (see the module) within ``deadline``
    (``time.monotonic()``). Raises :class:`HealRefused` when the state fails a check, and
    :class:`ExchangeError` when it cannot be read (late, refused, unreachable)."""
    parts = urllib.parse.urlsplit(url)
    left = deadline - time.monotonic()
    if left <= 0:
        raise ExchangeError(f"no time was left to heal from {url}")
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=left)
    try:
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ExchangeError(f"the healing source answered {resp.status} {resp.reason} for {url}")

        def timeout(seconds: float) -> None:
            if conn.sock is not None:
                conn.sock.settimeout(seconds)

        def readinto(view: memoryview) -> int:
            try:
                return resp.readinto(view)
            except http.client.IncompleteRead:  # the source closed the stream early
                return 0

        return _read(_Stream(readinto, deadline, timeout), url, secret, expect, limit)
    except (OSError, http.client.HTTPException) as e:
        raise ExchangeError(f"healing from {url} failed: {e!r}") from e
    finally:
        conn.close()
