"""Exact selection of the ``k`` largest magnitudes, fast on CPU for large leaves.

``lax.top_k`` on CPU keeps a heap of the ``k`` best: cheap while ``k`` is
small against the leaf, but about 29 ms for a 2.4M-entry leaf with ``k`` =
1% on one core, and slower still as ``k`` grows (it then sorts). The same
set comes from counting and bit operations, which XLA fuses into a few
passes (:func:`_select`):

1. The magnitude of every entry becomes a non-negative integer *key* whose
   order is the order of the magnitudes (the float's bits with the sign
   cleared; NaN ranks above inf, as in ``lax.top_k``).
2. The ``k``-th largest key ``v`` is found bit by bit, from the top bit down,
   by counting the keys at or above a candidate (:func:`_kth_key`).
3. Every key above ``v`` is taken, and of the keys equal to ``v`` the lowest
   indices that complete ``k``: the tie rule of ``lax.top_k``.
4. The taken entries are marked in 32-bit words (one bit per entry) and their
   indices written out in increasing order: a prefix sum over the words' bit
   counts gives each word its first slot (:func:`_positions`).

Step 2 counts over all entries 31 times, so a large leaf is first narrowed:
``lax.top_k`` over a strided sample gives a threshold that somewhat more than
``k`` entries pass (1.2 k on a 2.4M-entry leaf at 1%, 2 k on a 147k-entry
one); those are compacted (step 4) and steps 2-4 run on them alone.
When the sample misled (fewer than ``k``, or more than the room made for
them, passed), a ``lax.cond`` runs ``lax.top_k`` on the whole leaf instead:
the answer never depends on the sample, only the time does. Small leaves
with a small ``k`` go to ``lax.top_k`` directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

_LANES = 32  # entries per bit word
_STRIDE = 61  # sample stride of the threshold (odd and prime: it does not follow a leaf's rows)
_SAMPLED_MIN = 1 << 16  # smaller leaves are not sampled
_HEAP_SHARE = 8  # lax.top_k where k <= d / _HEAP_SHARE (its heap stays small)
_SCAN_MIN = 1 << 12  # running sums and maxima from this length up as log-depth scans


def magnitude_keys(x: jax.Array) -> jax.Array:
    """Integer keys ordered as ``|x|`` (NaN above inf, ``-0.0`` equal to ``0.0``), all >= 0."""
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.int64) & jnp.int64(2**63 - 1)
    as_int = {32: jnp.int32, 16: jnp.int16}[bits]
    keys = jax.lax.bitcast_convert_type(x, as_int) & as_int(2 ** (bits - 1) - 1)
    return keys.astype(jnp.int32)


def top_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices (int32, increasing) of the ``k`` largest magnitudes of a flat float ``x``.

    Ties go to the lower index, so the set is that of
    ``lax.top_k(magnitude_keys(x), k)``.
    """
    d = x.shape[0]
    if jnp.dtype(x.dtype).itemsize > 4:  # lax.top_k ranks floats as their keys only up to 32 bits
        return _select(magnitude_keys(x), k)
    plan = _sample_plan(d, k)
    if plan is not None:
        return _from_sample(x, k, *plan)
    if k * _HEAP_SHARE <= d:
        return _heap_top(x, k)
    return _select(magnitude_keys(x), k)


def top_indices_rows(x: jax.Array, k: int) -> jax.Array:
    """:func:`top_indices` of every row of ``x`` ``(rows, d)``: int32 ``(rows, k)``.

    One batched selection for all rows, compiled once; rows long enough to
    be narrowed by a sample go one after the other (``lax.map``) instead, so
    that the fallback on the whole row runs only where that row needs it.
    """
    if x.shape[0] == 1:
        return top_indices(x[0], k)[None]
    if jnp.dtype(x.dtype).itemsize <= 4 and _sample_plan(x.shape[1], k) is not None:
        return jax.lax.map(lambda row: top_indices(row, k), x)
    return jax.vmap(lambda row: top_indices(row, k))(x)


def _heap_top(x: jax.Array, k: int) -> jax.Array:
    return jnp.sort(jax.lax.top_k(jnp.abs(x).astype(jnp.float32), k)[1]).astype(jnp.int32)


def _from_sample(x: jax.Array, k: int, rank: int, room: int) -> jax.Array:
    """The two-stage selection: candidates above the sample's threshold, then steps 2-4 on them."""
    d = x.shape[0]
    sample = jnp.abs(x[::_STRIDE]).astype(jnp.float32)
    # The least of the top values, not the last one: XLA would turn top_k
    # followed by picking one element into a sort of the whole sample.
    t = jnp.min(jax.lax.top_k(sample, rank)[0])
    passed = _pack(magnitude_keys(x) >= magnitude_keys(t.astype(x.dtype)))
    count = jnp.sum(_bit_counts(passed))

    def candidates():
        cand = jnp.minimum(_positions(passed, room), d - 1)
        keys = jnp.where(jnp.arange(room) < count, magnitude_keys(x[cand]), -1)
        return cand[_select(keys, k)]

    # The branches read x, not its keys, so that no key array is written out.
    return jax.lax.cond((count >= k) & (count <= room), candidates, lambda: _heap_top(x, k))


def _sample_plan(d: int, k: int) -> tuple[int, int] | None:
    """(rank of the threshold in the sample, room for the entries it passes), or None.

    About ``k / _STRIDE`` sampled entries lie above the ``k``-th largest; the
    rank adds four standard deviations (and 4) so that, for a sample drawn
    at random, fewer than ``k`` entries pass with negligible probability; the
    room adds as much again above the rank.
    """
    m = k / _STRIDE
    rank = math.ceil(m + 4 * math.sqrt(m) + 4)
    room = math.ceil(_STRIDE * (rank + 4 * math.sqrt(rank) + 4))
    if d < _SAMPLED_MIN or rank > d // _STRIDE or 2 * room > d:
        return None
    return rank, room


def _select(keys: jax.Array, k: int) -> jax.Array:
    """Indices (increasing) of the ``k`` largest ``keys`` (>= 0; -1 marks a slot to skip)."""
    v = _kth_key(keys, k)
    above, equal = _pack(keys > v), _pack(keys == v)
    eq_counts = _bit_counts(equal)
    need = k - jnp.sum(_bit_counts(above))
    eq_before = _running_sum(eq_counts) - eq_counts
    take = above | _lowest_bits(equal, jnp.clip(need - eq_before, 0, _LANES))
    return _positions(take, k)


def _kth_key(keys: jax.Array, k: int) -> jax.Array:
    """The ``k``-th largest of non-negative ``keys``: the largest ``t`` with ``#{keys >= t} >= k``."""
    nbits = jnp.iinfo(keys.dtype).bits - 1

    def body(i, t):
        c = t | (jnp.ones([], keys.dtype) << (nbits - 1 - i).astype(keys.dtype))
        return jnp.where(jnp.sum(keys >= c, dtype=jnp.int32) >= k, c, t)

    zero = keys[0] & 0  # typed as the keys, varying over the axes where they vary
    return jax.lax.fori_loop(0, nbits, body, zero)


def _pack(mask: jax.Array) -> jax.Array:
    """A flat boolean mask as uint32 words, entry ``i`` at bit ``i % 32`` of word ``i // 32``."""
    words = -(-mask.shape[0] // _LANES)
    rows = jnp.pad(mask, (0, words * _LANES - mask.shape[0])).reshape(words, _LANES).astype(jnp.uint32)
    # Shifted 0/1 lanes summed: twice as fast on CPU as selecting the lane bits.
    return jnp.sum(rows << jnp.arange(_LANES, dtype=jnp.uint32)[None, :], axis=1, dtype=jnp.uint32)


def _running_sum(x: jax.Array) -> jax.Array:
    return _running(x, jnp.add, jnp.cumsum)


def _running_max(x: jax.Array) -> jax.Array:
    return _running(x, jnp.maximum, jax.lax.cummax)


def _running(x: jax.Array, op: Callable, windowed: Callable) -> jax.Array:
    """Inclusive running ``op`` over a flat integer array (``windowed``: JAX's own form).

    From ``_SCAN_MIN`` entries up a log-depth scan: ``jnp.cumsum`` and
    ``lax.cummax`` lower to windowed reductions that XLA:CPU runs 2.5-4x
    slower on 24k-74k entries (one core). Below it the windowed reduction,
    which compiles faster and costs next to nothing there.
    """
    return windowed(x) if x.shape[0] < _SCAN_MIN else jax.lax.associative_scan(op, x)


def _bit_counts(words: jax.Array) -> jax.Array:
    return jax.lax.population_count(words).astype(jnp.int32)


def _nth_bit(words: jax.Array, q: jax.Array) -> jax.Array:
    """Position of the ``q``-th (from 0) set bit of each word, for ``q`` below its bit count."""
    pos = jnp.zeros(q.shape, jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = _bit_counts(words & jnp.uint32((1 << width) - 1))
        skip = q >= low
        q = jnp.where(skip, q - low, q)
        words = jnp.where(skip, words >> width, words)
        pos = jnp.where(skip, pos + width, pos)
    return pos


def _lowest_bits(words: jax.Array, j: jax.Array) -> jax.Array:
    """Each word with only its ``j`` lowest set bits kept (``0 <= j <= 32``)."""
    cut = _nth_bit(words, jnp.minimum(j, _LANES - 1)).astype(jnp.uint32)
    below = (jnp.uint32(1) << cut) - jnp.uint32(1)
    kept = jnp.where(j >= _bit_counts(words), words, words & below)
    return jnp.where(j == 0, jnp.uint32(0), kept)


def _positions(words: jax.Array, size: int) -> jax.Array:
    """Indices of the set bits of ``words``, increasing, in ``size`` slots.

    Each word with set bits is written at its first slot; a running maximum
    carries it over its other slots. Slots past the number of set bits hold
    indices that mean nothing.
    """
    counts = _bit_counts(words)
    starts = _running_sum(counts) - counts
    at = jnp.where(counts > 0, starts, size)  # distinct where kept; the rest dropped
    first = jnp.zeros((size,), jnp.int32).at[at].set(jnp.arange(words.shape[0], dtype=jnp.int32), mode="drop")
    w = _running_max(first)
    bit = _nth_bit(words[w], jnp.arange(size, dtype=jnp.int32) - starts[w])
    return w * _LANES + bit
