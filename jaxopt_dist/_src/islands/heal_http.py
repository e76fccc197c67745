"""Healing over HTTP, without pickle: a server that streams a state's arrays raw, and a client with a deadline.

torchft's checkpoint transport plays this part for torch (its ``HTTPTransport``
pickles what it sends, serves on every interface and advertises the host's
name). Here a healing state (nested dicts and lists of arrays and plain
numbers or strings) crosses as::

    MAGIC | header length (8 bytes, little-endian) | JSON header | each array's raw bytes

The header gives the tree's shape with each array's dtype and shape, and the
receiver allocates each array from it and reads its bytes into it: nothing
received is ever unpickled or evaluated. :class:`HealServer` listens on one
address (the island's) and serves one staged state, under the step it was
staged for; :func:`fetch` reads one within a deadline (the heal's own
timeout, not the exchange's), checking the total size against a limit
before allocating anything.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse
from typing import Any

import numpy as np

from jaxopt_dist._src.islands.transport import ExchangeError

MAGIC = b"JDHEAL1\n"
MAX_HEADER = 64 * 2**20
CHUNK = 2**20


def encode(tree: Any) -> tuple[bytes, list[np.ndarray]]:
    """``tree`` as a JSON header and the arrays whose raw bytes follow it."""
    arrays: list[np.ndarray] = []
    skeleton = _skeleton(tree, arrays)
    specs = [[a.dtype.name, list(a.shape)] for a in arrays]
    header = json.dumps({"tree": skeleton, "arrays": specs}).encode()
    return header, arrays


def _skeleton(x: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError("a healing state's dict keys must be strings")
        return {"d": {k: _skeleton(v, arrays) for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return {"l": [_skeleton(v, arrays) for v in x]}
    if x is None or (isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic)):
        return {"v": x}
    a = np.asarray(x)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        a = a.copy(order="C")
    if a.dtype.hasobject:
        raise TypeError(f"a healing state holds arrays of numbers only; got dtype {a.dtype}")
    arrays.append(a)
    return {"a": len(arrays) - 1}


def _rebuild(skeleton: Any, arrays: list[np.ndarray]) -> Any:
    ((kind, body),) = skeleton.items()
    if kind == "d":
        return {k: _rebuild(v, arrays) for k, v in body.items()}
    if kind == "l":
        return [_rebuild(v, arrays) for v in body]
    if kind == "a":
        return arrays[int(body)]
    if kind == "v":
        return body
    raise ExchangeError(f"a healing state's header holds an unknown node {kind!r}")


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # knows bfloat16 and the other ml_dtypes by name

    dtype = np.dtype(jnp.dtype(name))
    if dtype.hasobject:
        raise ExchangeError(f"a healing state may not hold arrays of {name}")
    return dtype


class HealServer:
    """Serves one staged healing state over HTTP on ``host`` (``GET /heal/<step>``).

    Args:
      host: the address to listen on (the island's); port 0 picks a free one.
      send_timeout: seconds a send to a stalled peer may block before the
        connection is dropped.
    """

    def __init__(self, host: str, *, port: int = 0, send_timeout: float = 60.0):
        self._lock = threading.Condition()
        self._wait = send_timeout
        self._staged: tuple[int, bytes, list[np.ndarray]] | None = None
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
        header, arrays = encode(tree)
        with self._lock:
            self._staged = (int(step), header, arrays)
            self._lock.notify_all()

    def staged(self, step: int) -> tuple[bytes, list[np.ndarray]] | None:
        """The state staged for ``step``; a request for a step not staged yet waits (a peer may ask
        before this island's quorum has staged it) up to the send timeout; None for an older step."""
        with self._lock:
            ready = lambda: self._staged is not None and self._staged[0] >= step  # noqa: E731
            self._lock.wait_for(ready, timeout=self._wait)
            if self._staged is None or self._staged[0] != step:
                return None  # not staged in time, or an older step than the one staged
            return self._staged[1], self._staged[2]

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
            staged = server.staged(step) if step >= 0 else None
            if staged is None:
                self.send_error(404, f"no healing state for {self.path}")
                return
            header, arrays = staged
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            size = len(MAGIC) + 8 + len(header) + sum(a.nbytes for a in arrays)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for a in arrays:
                self.wfile.write(_bytes(a))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            del format, args

    return Handler


def fetch(url: str, *, deadline: float, limit: int | None = None) -> Any:
    """The healing state at ``url``, read within ``deadline`` (``time.monotonic()``); at most ``limit``
    bytes of arrays. Raises :class:`ExchangeError` when it cannot (late, refused, malformed)."""
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
        return _read_state(resp, conn, deadline, limit, url)
    except (OSError, http.client.HTTPException) as e:
        raise ExchangeError(f"healing from {url} failed: {e!r}") from e
    finally:
        conn.close()


def _read_state(resp: Any, conn: Any, deadline: float, limit: int | None, url: str) -> Any:
    def read(n: int) -> bytes:
        buf = bytearray(n)
        _read_into(memoryview(buf), resp, conn, deadline, url)
        return bytes(buf)

    if read(len(MAGIC)) != MAGIC:
        raise ExchangeError(f"{url} did not send a healing state")
    (n_header,) = struct.unpack("<Q", read(8))
    if n_header > MAX_HEADER:
        raise ExchangeError(f"{url} sent a header of {n_header} bytes (at most {MAX_HEADER})")
    try:
        header = json.loads(read(n_header))
        specs = [(_dtype(str(d)), tuple(int(n) for n in shape)) for d, shape in header["arrays"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ExchangeError(f"{url} sent a malformed header: {e}") from e
    total = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for dtype, shape in specs)
    if limit is not None and total > limit:
        raise ExchangeError(f"{url} offered {total} bytes of state; this island expects at most {limit}")
    arrays = []
    for dtype, shape in specs:
        a = np.empty(shape, dtype)
        _read_into(_bytes(a), resp, conn, deadline, url)
        arrays.append(a)
    try:
        return _rebuild(header["tree"], arrays)
    except (RecursionError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ExchangeError(f"{url} sent a malformed header: {e!r}") from e


def _bytes(a: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, writable where the array is (any dtype, bfloat16 included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _read_into(view: memoryview, resp: Any, conn: Any, deadline: float, url: str) -> None:
    done = 0
    while done < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExchangeError(f"the heal from {url} did not finish within its timeout")
        if conn.sock is not None:
            conn.sock.settimeout(left)
        n = resp.readinto(view[done : done + CHUNK])
        if not n:
            raise ExchangeError(f"{url} closed the connection before the state was complete")
        done += n
