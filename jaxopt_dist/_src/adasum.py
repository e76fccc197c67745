r"""AdaSum: adaptive summation of the workers' updates over a tree of ppermutes.

Two workers' vectors :math:`a, b` are combined as

.. math::
  A(a, b) = \Big(1 - \frac{a \cdot b}{2 \|a\|^2}\Big) a
          + \Big(1 - \frac{a \cdot b}{2 \|b\|^2}\Big) b,

which is the sum for orthogonal vectors, the common value for equal ones, and
in between otherwise (Maleki et al. 2020). :func:`adasum` applies ``A`` per
leaf up a fixed binary tree over the workers, for any worker count; see
:func:`adasum_tree` for the exact order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxopt_dist._src import base, comm

_METHODS = ("butterfly", "halving")
_NO_EXPONENT = -(1 << 20)  # below any float's exponent: the scale exponent of a zero leaf


def _power_of_two_below(n: int) -> int:
    """The largest power of two that is at most ``n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def _bit_reverse(i: int, bits: int) -> int:
    out = 0
    for _ in range(bits):
        out = (out << 1) | (i & 1)
        i >>= 1
    return out


def adasum_tree(num_workers: int | None = None, *, n: int | None = None) -> Any:
    """The order in which :func:`adasum` combines ``n = num_workers`` workers, as nested pairs.

    Let ``p`` be the largest power of two with ``p <= n`` and ``r = n - p``.
    First each worker ``j < r`` absorbs worker ``p + j``: ``y_j = A(x_j, x_{p+j})``
    (``y_j = x_j`` for ``r <= j < p``). Then, for ``s = 0, 1, ..., log2(p) - 1``,
    the groups of ``2**s`` consecutive workers are paired: ``A(lower group,
    upper group)``, which is the recursive-doubling butterfly where at round
    ``s`` a worker pairs with the one whose index differs in bit ``s``.

    A pair ``(u, v)`` below means ``A(u, v)`` with ``u`` as the first argument
    (``A`` is symmetric in exact arithmetic; the order fixes the rounding).

    Args:
      num_workers: the number of workers ``n``.
      n: the deprecated spelling of ``num_workers`` (a ``DeprecationWarning``;
        it goes away in the next release).

    Examples:
      >>> adasum_tree(3)
      ((0, 2), 1)
      >>> adasum_tree(6)
      (((0, 4), (1, 5)), (2, 3))
      >>> adasum_tree(8)
      (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    """
    num_workers = base.renamed_keyword(num_workers, n, new="num_workers", old="n")
    n = base.check_positive_int(num_workers, "num_workers")
    p = _power_of_two_below(n)
    nodes: list[Any] = [(j, p + j) if p + j < n else j for j in range(p)]
    while len(nodes) > 1:
        nodes = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes), 2)]
    return nodes[0]


class _Layout:
    """Static packing of same-dtype leaves into a ``(p, M)`` buffer.

    Leaf ``l`` is flattened, zero padded to ``cols[l] * p`` elements and
    reshaped to ``(p, cols[l])``; the leaves sit side by side along the
    columns, so splitting rows splits every leaf at once.

    Leaves of equal column counts sit next to each other (a *bucket*), so
    that the columns of a bucket of ``L_b`` leaves of ``c_b`` columns each
    are a ``(rows, L_b, c_b)`` array (:meth:`_views`): per-leaf scalars
    broadcast along its middle axis and per-leaf reductions run over its
    other two, one operation per bucket whatever the number of leaves. Every
    per-leaf vector below (exponents, dot products) is in this layout's leaf
    order, bucket after bucket.
    """

    def __init__(self, leaves: list[jax.Array], p: int):
        self.dtype = leaves[0].dtype
        self.p = p
        self.compute_dtype = base.accumulation_dtype(self.dtype)
        sizes = base.leaf_sizes(leaves)
        buckets: dict[int, list[int]] = {}
        for i, s in enumerate(sizes):
            buckets.setdefault(-(-s // p), []).append(i)
        self.order = [i for ids in buckets.values() for i in ids]  # the leaves, bucket after bucket
        self.shapes = [leaves[i].shape for i in self.order]
        self.sizes = [sizes[i] for i in self.order]
        self.cols = [-(-s // p) for s in self.sizes]
        self.offsets = [int(o) for o in np.cumsum([0, *self.cols])[:-1]]
        self.width = int(sum(self.cols))
        self.buckets = [(len(ids), c) for c, ids in buckets.items()]  # (leaves, columns each)

    def pack(self, leaves: list[jax.Array]) -> jax.Array:
        parts = [
            jnp.pad(jnp.ravel(leaves[i]), (0, c * self.p - s)).reshape(self.p, c)
            for i, s, c in zip(self.order, self.sizes, self.cols)
        ]
        return jnp.concatenate(parts, axis=1)

    def unpack(self, buf: jax.Array) -> list[jax.Array]:
        out: list[Any] = [None] * len(self.order)
        cut = base.pieces(buf, zip(self.offsets, self.cols), axis=1)  # one kernel per width
        for i, x, s, shape in zip(self.order, cut, self.sizes, self.shapes):
            out[i] = x.reshape(-1)[:s].reshape(shape)
        return out

    def _views(self, buf: jax.Array) -> list[jax.Array]:
        """``buf`` ``(rows, M)`` as one ``(rows, L_b, c_b)`` array per bucket."""
        out, start = [], 0
        for count, c in self.buckets:
            out.append(buf[:, start : start + count * c].reshape(buf.shape[0], count, c))
            start += count * c
        return out

    def _join(self, views: list[jax.Array]) -> jax.Array:
        """Inverse of :meth:`_views`."""
        return jnp.concatenate([v.reshape(v.shape[0], -1) for v in views], axis=1)

    def _per_bucket(self, v: jax.Array) -> list[jax.Array]:
        """Per-leaf values ``(..., L)`` cut by bucket, each ``(..., 1, L_b, 1)`` to broadcast against a view."""
        out, start = [], 0
        for count, _ in self.buckets:
            out.append(v[..., None, start : start + count, None])
            start += count
        return out

    def exponents(self, mine: jax.Array, other: jax.Array, first: jax.Array) -> jax.Array:
        """Per leaf, the binary exponents ``e`` with ``max|x| = m 2^e``, ``m`` in [0.5, 1): shape ``(2, L)``.

        Row 0 is for the pair's first argument ``a`` (``mine`` where
        ``first``, else ``other``), row 1 for the second ``b``. Over the rows
        held; ``_NO_EXPONENT`` for a zero leaf (see :func:`_settle`). Dividing
        a leaf by ``2^e`` is exact and brings its largest entry to [0.5, 1),
        so its squared norm lies in [0.25, size]: it cannot underflow or
        overflow. Subnormal entries count (see :meth:`_peak_bits`).
        """
        peaks = [self._peak_bits(x.astype(self.compute_dtype)) for x in (mine, other)]
        mine_first = jnp.stack(peaks)
        return _frexp_exponent(jnp.where(first, mine_first, mine_first[::-1]), self.compute_dtype)

    def _peak_bits(self, x: jax.Array) -> jax.Array:
        """Per leaf, the magnitude bits (:func:`_magnitude_bits`) of its largest entry, shape ``(L,)``.

        A float ``max |x|`` runs several times faster on CPU than the same
        reduction over integer bits, and it is exact whenever the largest
        magnitude is a normal number: a backend that flushes subnormals in
        comparisons still ranks every normal above them. Only where some
        leaf's float maximum is zero or subnormal (an all-zero leaf, or one
        whose entries are all subnormal) are the bits compared instead.
        """
        nmant, _, _, _ = _bit_layout(x.dtype)
        views = self._views(x)
        fast = _magnitude_bits(jnp.concatenate([jnp.max(jnp.abs(v), axis=(0, 2)) for v in views]))

        def from_bits(views):
            return jnp.concatenate([jnp.max(_magnitude_bits(v), axis=(0, 2)) for v in views])

        return jax.lax.cond(jnp.all((fast >> nmant) > 0), lambda v: fast, from_bits, views)

    def needs_bits(self, exps: jax.Array) -> jax.Array:
        """Whether some leaf's pair peaks so close to the subnormal range that
        subnormal entries or results can matter: ``max(e_a, e_b)`` within
        ``nmant + 2`` binades of the smallest normal.

        Elsewhere a subnormal entry or result is below half a unit in the
        last place of the pair's largest entries, and the plain arithmetic
        (which XLA:CPU flushes) gives the same sums. Read from ``exps``, so the
        workers computing one pair (or one group's rows) agree.
        """
        nmant, bias, _, _ = _bit_layout(self.compute_dtype)
        return jnp.min(jnp.maximum(exps[0], exps[1])) < (1 - bias) + nmant + 2

    def _ordered(self, mine: jax.Array, other: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The pair ``(a, b)`` (``(mine, other)`` where ``first``, else swapped), in the compute dtype.

        Chosen elementwise, so that XLA fuses the choice into the consumer
        instead of writing ``a`` and ``b`` out.
        """
        a = jnp.where(first, mine, other).astype(self.compute_dtype)
        b = jnp.where(first, other, mine).astype(self.compute_dtype)
        return a, b

    def _by_precision(
        self, exact: Any, plain: Any, exps: jax.Array, mine: jax.Array, other: jax.Array
    ) -> jax.Array:
        """``exact(mine, other)`` where :meth:`needs_bits`, else ``plain(mine, other)``, in a ``lax.cond``.

        Each branch takes the pair's raw vectors and does its own scaling, so
        the only arrays written out are the branch's result.
        """
        return jax.lax.cond(self.needs_bits(exps), exact, plain, mine, other)

    def dots(self, mine: jax.Array, other: jax.Array, first: jax.Array, exps: jax.Array) -> jax.Array:
        """``[a'.b', |a'|^2, |b'|^2]`` per leaf over the rows held, as two-floats: shape ``(2, 3, L)``.

        Row 0 holds the high parts, row 1 the low parts. ``a' = a 2^-e_a`` and
        ``b' = b 2^-e_b`` (``exps`` from :meth:`exponents`), exact: largest
        entries in [0.5, 1); where :meth:`needs_bits`, subnormal inputs are
        read from their bits (see :func:`_normalize`). See
        :func:`_three_dots` for the sums, one batched sum per bucket.
        """
        scales = [self._per_bucket(-exps[k]) for k in (0, 1)]

        def run(scale):
            def sums(mine, other):
                a, b = self._ordered(mine, other, first)
                pairs = zip(self._views(a), self._views(b), *scales)
                return jnp.concatenate(
                    [
                        _three_dots_batched(_leaf_major(scale(x, ea)), _leaf_major(scale(y, eb)))
                        for x, y, ea, eb in pairs
                    ],
                    axis=-1,
                )

            return sums

        return self._by_precision(run(_normalize), run(_times_pow2), exps, mine, other)

    def combine(
        self, mine: jax.Array, other: jax.Array, first: jax.Array, dots: jax.Array, exps: jax.Array
    ) -> jax.Array:
        """``A(a, b)`` leaf by leaf, from :meth:`exponents` and :meth:`dots`.

        With ``a = a' 2^e_a``, ``b = b' 2^e_b`` and ``m = max(e_a, e_b)``, the
        pair sum is formed at the scale ``2^-m``, where its largest entries
        are near 1,

        ``A(a, b) 2^-m = c_a a' + c_b b'``, with ``c_a = 2^(e_a - m) - r_a 2^(e_b - m)``,
        ``c_b = 2^(e_b - m) - r_b 2^(e_a - m)`` and ``r = a'.b' / 2|.|^2``

        (the coefficients as two-floats, the sum rounded once, see
        :func:`_combined`), and scaled back by ``2^m`` at the end (where
        :meth:`needs_bits`, on the bits: a result among the subnormals is
        rounded once, see :func:`_denormalize`). Every factor stays in range,
        however far apart the two vectors' magnitudes are; the powers of two
        below 1 can only flush terms below the precision of the larger
        vector. In the normal range the scalings are exact.
        """
        dot, na, nb = dots[:, 0], dots[:, 1], dots[:, 2]
        top = jnp.maximum(exps[0], exps[1])
        sa = _pow2_at_most_one(exps[0] - top, self.compute_dtype)
        sb = _pow2_at_most_one(exps[1] - top, self.compute_dtype)
        # per leaf, two-floats: c_a = 2^(e_a - m) - r_a 2^(e_b - m), c_b = 2^(e_b - m) - r_b 2^(e_a - m)
        ca = _coefficient(sa, sb, _half_ratio(dot, na))
        cb = _coefficient(sb, sa, _half_ratio(dot, nb))
        scalars = [self._per_bucket(v) for v in (-exps[0], -exps[1], top, *ca, *cb)]

        def run(scale, unscale):
            def pair_sum(mine, other):
                a, b = self._ordered(mine, other, first)
                out = []
                for x, y, ea, eb, m, ca0, ca1, cb0, cb1 in zip(self._views(a), self._views(b), *scalars):
                    z = _combined(scale(x, ea), scale(y, eb), (ca0, ca1), (cb0, cb1))
                    out.append(unscale(z, m).astype(self.dtype))
                return self._join(out)

            return pair_sum

        return self._by_precision(
            run(_normalize, _denormalize), run(_times_pow2, _times_pow2), exps, mine, other
        )


def _leaf_major(view: jax.Array) -> jax.Array:
    """A bucket's view ``(rows, L_b, c_b)`` as ``(L_b, rows, c_b)``, for sums per leaf."""
    return jnp.transpose(view, (1, 0, 2))


def _combined(a1: jax.Array, b1: jax.Array, ca: Any, cb: Any) -> jax.Array:
    """``A(a, b) 2^-m = c_a a' + c_b b'`` (see :meth:`_Layout.combine`), rounded once.

    ``ca`` and ``cb`` are two-floats ``(hi, lo)``. The products of the high
    parts are split exactly (:func:`_two_product`), the two summed exactly
    (:func:`_two_sum`), and the error terms added before the one rounding.
    """
    p1, e1 = _two_product(ca[0], a1)
    p2, e2 = _two_product(cb[0], b1)
    s, t = _two_sum(p1, p2)
    return s + (((t + e1) + e2) + (ca[1] * a1 + cb[1] * b1))


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x = hi + lo`` exactly, ``hi`` with the upper half of the significand (12 of float32's 24 bits).

    ``hi`` is ``x`` rounded on its bits (add half of the dropped last place,
    clear the dropped bits), so ``|lo| <= ulp(hi) / 2`` and products of
    halves are exact: Dekker's split without the multiplication that a
    fused multiply-add could contract. For finite normal ``x``.
    """
    nmant, _, ut, _ = _bit_layout(x.dtype)
    drop = (nmant + 2) // 2
    bits = jax.lax.bitcast_convert_type(x, ut) + ut.type(1 << (drop - 1))
    hi = jax.lax.bitcast_convert_type(bits & ut.type(~((1 << drop) - 1) & np.iinfo(ut).max), x.dtype)
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth; no multiplications)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _two_product(x: jax.Array, y: jax.Array, xs: Any = None, ys: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(p, e)`` with ``p = fl(x y)`` and ``p + e = x y`` exactly (Dekker), splits reusable.

    Every product of halves is exact, so a compiler that fuses a product
    into a following addition computes the same values.
    """
    x1, x2 = _split(x) if xs is None else xs
    y1, y2 = _split(y) if ys is None else ys
    p = x * y
    return p, ((x1 * y1 - p) + x1 * y2 + x2 * y1) + x2 * y2


def _two_add(x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
    """The sum of two two-floats ``(hi, lo)``, not renormalised (the reduction step of :func:`_three_dots`)."""
    s, t = _two_sum(x[0], y[0])
    return s, (x[1] + y[1]) + t


_SUM_WIDTH = 32  # entries added in sequence per level of :func:`_three_dots`


def _three_dots(a: jax.Array, b: jax.Array) -> jax.Array:
    """``(a.b, a.a, b.b)`` over all entries as two-floats ``[[hi x3], [lo x3]]``, shape ``(2, 3)``.

    Compensated (Ogita, Rump and Oishi's ``Dot2``): every product enters as
    its exact two-float (:func:`_two_product`), and the partial sums are
    added as two-floats (:func:`_two_sum` of the high parts, the low parts
    and the error summed plainly), so the error is that of a float32 sum of
    about twice the precision: ``|err| <= eps |s| + O(n eps^2) sum |a_i b_i|``,
    as Horovod's float64 sums. Each level of the tree reduces groups of
    ``_SUM_WIDTH`` along the last axis (zero padded), one reduction for all
    six running values, until one is left. The three sums share their order,
    so equal inputs give equal results exactly. The products are formed
    inside the first level: on CPU, one sum over stacked products would
    write the product arrays out first, and separate sums may be compiled
    in different orders.
    """
    return _three_dots_batched(a[None], b[None])[..., 0]


def _three_dots_batched(a: jax.Array, b: jax.Array) -> jax.Array:
    """:func:`_three_dots` of each ``a[l], b[l]`` along the leading axis, in one reduction: ``(2, 3, L)``."""
    zero = jnp.zeros([], a.dtype)
    sa, sb = _split(a), _split(b)

    def add(x, y):
        return tuple(v for k in range(0, 6, 2) for v in _two_add(x[k : k + 2], y[k : k + 2]))

    parts = (*_two_product(a, b, sa, sb), *_two_product(a, a, sa, sa), *_two_product(b, b, sb, sb))
    while parts[0].shape[-1] > _SUM_WIDTH:
        pad = [(0, 0)] * (parts[0].ndim - 1) + [(0, -parts[0].shape[-1] % _SUM_WIDTH)]
        grouped = tuple(jnp.pad(x, pad).reshape(*x.shape[:-1], -1, _SUM_WIDTH) for x in parts)
        parts = tuple(
            x.reshape(x.shape[0], -1)
            for x in jax.lax.reduce(grouped, (zero,) * 6, add, (grouped[0].ndim - 1,))
        )
    sums = jax.lax.reduce(parts, (zero,) * 6, add, tuple(range(1, parts[0].ndim)))
    return jnp.stack([jnp.stack(v) for v in zip(*(_two_sum(*sums[k : k + 2]) for k in (0, 2, 4)))])


def _sum_two_floats(x: jax.Array) -> jax.Array:
    """The sum over the leading axis (a power of two long) of two-floats ``x[i] = (hi, lo)``, pairwise, in a fixed order."""
    while x.shape[0] > 1:
        x = jnp.stack(_two_add((x[0::2, 0], x[0::2, 1]), (x[1::2, 0], x[1::2, 1])), axis=1)
    return jnp.stack(_two_sum(x[0, 0], x[0, 1]))


def _settle(exps: jax.Array) -> jax.Array:
    """Exponent 0 for zero leaves (any exact scale would do)."""
    return jnp.where(exps == _NO_EXPONENT, 0, exps)


def _bit_layout(dtype: Any) -> tuple[int, int, Any, Any]:
    """``(mantissa bits, exponent bias, unsigned int type, signed int type)`` of a float32/float64."""
    info = jnp.finfo(dtype)
    width = jnp.dtype(dtype).itemsize * 8
    return info.nmant, info.maxexp - 1, jnp.dtype(f"uint{width}"), jnp.dtype(f"int{width}")


def _pow2_at_most_one(k: jax.Array, dtype: Any) -> jax.Array:
    """``2^k`` for integer ``k <= 0``, built from its bits; 0 where it is below the normal range."""
    nmant, bias, ut, _ = _bit_layout(dtype)
    bits = (jnp.maximum(k + bias, 0).astype(ut)) << nmant
    return jax.lax.bitcast_convert_type(bits, dtype)


def _magnitude_bits(x: jax.Array) -> jax.Array:
    """``|x|`` as unsigned bits: for finite floats their order is the order of magnitudes."""
    _, _, ut, _ = _bit_layout(x.dtype)
    bits = jax.lax.bitcast_convert_type(x, ut)
    return bits & ut.type(np.iinfo(ut).max >> 1)


def _bit_length(m: jax.Array) -> jax.Array:
    return (m.dtype.itemsize * 8 - jax.lax.clz(m)).astype(jnp.int32)


def _frexp_exponent(mag_bits: jax.Array, dtype: Any) -> jax.Array:
    """The exponent of ``frexp`` of the float whose magnitude bits are given (subnormals included)."""
    nmant, bias, ut, _ = _bit_layout(dtype)
    field = (mag_bits >> nmant).astype(jnp.int32)
    frac = mag_bits & ut.type((1 << nmant) - 1)
    sub = _bit_length(frac) - (bias + nmant - 1)
    e = jnp.where(field > 0, field - (bias - 1), sub)
    return jnp.where(mag_bits > 0, e, _NO_EXPONENT).astype(jnp.int32)


def _pow2_pair(k: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Two normal powers of two whose product is ``2^k`` (``|k|`` up to about twice the exponent range)."""
    nmant, bias, ut, _ = _bit_layout(dtype)

    def pow2(j):
        return jax.lax.bitcast_convert_type(jnp.clip(j + bias, 1, 2 * bias).astype(ut) << nmant, dtype)

    half = k // 2
    return pow2(half), pow2(k - half)


def _subnormal_unit_exponent(dtype: Any) -> int:
    """``s`` with the last place of a subnormal worth ``2^-s`` (149 for float32)."""
    nmant, bias, _, _ = _bit_layout(dtype)
    return bias + nmant - 1


def _times_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x 2^e`` (``e`` an integer broadcast against ``x``), by two multiplications.

    Exact where operands and result are normal.
    """
    f1, f2 = _pow2_pair(e, x.dtype)
    return x * f1 * f2


def _normalize(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x 2^e`` (``e`` an integer broadcast against ``x``), exact where the result is normal.

    Subnormal entries of ``x``, which XLA:CPU's arithmetic reads as zero, are
    taken from their bits: a subnormal is its mantissa field times ``2^-s``.
    """
    nmant, _, ut, _ = _bit_layout(x.dtype)
    bits = jax.lax.bitcast_convert_type(x, ut)
    tiny = (bits >> nmant) & ut.type((np.iinfo(ut).max >> 1) >> nmant) == 0
    mag = (bits & ut.type((1 << nmant) - 1)).astype(x.dtype)  # exact: fewer than nmant + 1 bits
    signed = jnp.where(bits >> (ut.itemsize * 8 - 1) == 1, -mag, mag)
    below = _times_pow2(signed, e - _subnormal_unit_exponent(x.dtype))
    return jnp.where(tiny, below, _times_pow2(x, e))


def _denormalize(y: jax.Array, e: jax.Array) -> jax.Array:
    """``y 2^e`` for ``e`` per leaf, rounded once to nearest even, subnormal results included.

    A result below the normal range is built from its bits (XLA:CPU's
    arithmetic would flush it to zero): its mantissa field is ``|y| 2^(e + s)``
    rounded to an integer, a product that is itself exact.
    """
    nmant, _, ut, _ = _bit_layout(y.dtype)
    units = _times_pow2(jnp.abs(y), e + _subnormal_unit_exponent(y.dtype))
    field = jnp.round(jnp.minimum(units, float(1 << (nmant + 1)))).astype(ut)
    sign = jax.lax.bitcast_convert_type(y, ut) & ut.type(1 << (ut.itemsize * 8 - 1))
    tiny = jax.lax.bitcast_convert_type(field | sign, y.dtype)
    return jnp.where(units < float(1 << nmant), tiny, _times_pow2(y, e))


def _half_ratio(dot: Any, norm_sq: Any) -> tuple[jax.Array, jax.Array]:
    """``dot / (2 |x|^2)`` from two-floats ``(hi, lo)``, as a two-float; 0 for a zero vector.

    A two-float division: the quotient of the high parts, then the
    remainder (exact: :func:`_two_product`, Sterbenz) over the divisor.
    """
    ok = norm_sq[0] > 0
    den = jnp.where(ok, norm_sq[0], jnp.ones_like(norm_sq[0]))
    q1 = dot[0] / den
    p, e = _two_product(q1, den)
    q2 = ((((dot[0] - p) - e) + dot[1]) - q1 * norm_sq[1]) / den
    hi, lo = _two_sum(q1, q2)
    zero = jnp.zeros_like(hi)
    return jnp.where(ok, 0.5 * hi, zero), jnp.where(ok, 0.5 * lo, zero)


def _coefficient(own: jax.Array, other: jax.Array, ratio: Any) -> tuple[jax.Array, jax.Array]:
    """``own - ratio * other`` for powers of two ``own, other <= 1`` and a two-float ratio, as a two-float."""
    hi, t = _two_sum(own, -(ratio[0] * other))
    return _two_sum(hi, t - ratio[1] * other)


class _Tree(NamedTuple):
    """What every stage of :func:`_run_tree` shares: the layouts and this worker's place."""

    layouts: list[_Layout]
    axis_name: base.AxisName
    n: int
    p: int
    idx: jax.Array  # this worker's index

    def pair(self, mine: list[jax.Array], other: list[jax.Array], first: jax.Array) -> list[jax.Array]:
        """``A(a, b)`` of every layout, ``(a, b) = (mine, other)`` where ``first``, else swapped."""
        out = []
        for lay, x, y in zip(self.layouts, mine, other):
            exps = _settle(lay.exponents(x, y, first))
            out.append(lay.combine(x, y, first, lay.dots(x, y, first, exps), exps))
        return out


def _butterfly_levels(n: int, p: int) -> list[tuple[list[tuple[int, int]], np.ndarray, np.ndarray]]:
    """Per level of the butterfly, with the fold first where ``n`` is no power of two:
    ``(permutation, first, keep)``, the last two per worker: whether it holds the pair's
    first argument, and whether it keeps the pair's result."""
    r = n - p
    workers = np.arange(n)
    levels = []
    if r:  # worker j < r swaps vectors with worker p + j and both compute A(x_j, x_{p+j})
        fold = [(j, p + j) for j in range(r)] + [(p + j, j) for j in range(r)] + [(j, j) for j in range(r, p)]
        levels.append((fold, workers < p, (workers < r) | (workers >= p)))
    extras = [(e, e) for e in range(p, n)]
    for s in range(p.bit_length() - 1):  # worker i < p pairs with i XOR 2**s, the lower first
        pairs = [(i, i ^ (1 << s)) for i in range(p)] + extras
        levels.append((pairs, ((workers >> s) & 1) == 0, np.ones(n, bool)))
    return levels


def _butterfly(tree: _Tree, bufs: list[jax.Array]) -> list[jax.Array]:
    """Every level of the butterfly in one loop: the pair sum is compiled once, whatever ``n``.

    Each level sends along its own permutation (a ``lax.switch`` on the
    level picks the ``ppermute``) and computes the same pair sum; the
    workers that do not keep a level's result (the fold's unpaired ones)
    keep their vectors.
    """
    levels = _butterfly_levels(tree.n, tree.p)
    if not levels:  # one worker
        return bufs
    first_of = jnp.asarray(np.stack([f for _, f, _ in levels]))
    keep_of = jnp.asarray(np.stack([k for _, _, k in levels]))
    sends = [
        lambda b, perm=perm: comm.ppermute(b, tree.axis_name, perm, caller="adasum") for perm, _, _ in levels
    ]

    def level(s, bufs):
        recv = sends[0](bufs) if len(levels) == 1 else jax.lax.switch(s, sends, bufs)
        paired = tree.pair(bufs, recv, first_of[s, tree.idx])
        return [jnp.where(keep_of[s, tree.idx], x, y) for x, y in zip(paired, bufs)]

    if len(levels) == 1:
        return level(0, bufs)
    return jax.lax.fori_loop(0, len(levels), level, bufs)


def _halving(tree: _Tree, bufs: list[jax.Array]) -> list[jax.Array]:
    """Recursive halving, every level in one loop: the arithmetic is compiled once.

    At level ``s`` each worker keeps the half of its ``p >> s`` rows it owns,
    sends the other half to its partner, and the partial dot products are
    summed over the group of ``2**(s+1)`` workers that share a pair. The
    exchanges, whose sizes differ by level, are the branches of a
    ``lax.switch`` on the level; the arithmetic runs on ``p / 2`` rows at every
    level, the rows beyond the level's half zero (they add nothing to a
    maximum or a sum, and pair to zeros). Returns the buffers with the
    result's row first.
    """
    p, idx, layouts = tree.p, tree.idx, tree.layouts
    rounds = p.bit_length() - 1
    splits = np.cumsum([len(lay.cols) for lay in layouts])[:-1]

    def level(s, bufs):
        low = ((idx >> s) & 1) == 0  # this worker holds the first argument of A
        keep, recv = _one_of(rounds, lambda k: lambda b: _halving_exchange(tree, b, low, k), s, bufs)
        # The scale of each vector is the largest over the rows the group holds.
        local = jnp.concatenate([lay.exponents(x, y, low) for lay, x, y in zip(layouts, keep, recv)], axis=1)
        top = _one_of(rounds, lambda k: lambda e: _group_exponents(tree, e, k), s, local)
        exps = [_settle(e) for e in jnp.split(top, splits, axis=1)]
        partial = [lay.dots(x, y, low, e) for lay, x, y, e in zip(layouts, keep, recv, exps)]
        dots = jnp.split(_group_dots(tree, jnp.concatenate(partial, -1), s), splits, axis=-1)
        out = [lay.combine(x, y, low, d, e) for lay, x, y, d, e in zip(layouts, keep, recv, dots, exps)]
        return [jnp.pad(x, ((0, p - x.shape[0]), (0, 0))) for x in out]

    return jax.lax.fori_loop(0, rounds, level, bufs) if rounds > 1 else level(0, bufs)


def _one_of(count: int, make: Any, s: Any, *operands: Any) -> Any:
    """``make(k)(*operands)`` for the level ``k = s``: a ``lax.switch`` over the ``count`` levels."""
    if count == 1:
        return make(0)(*operands)
    return jax.lax.switch(s, [make(k) for k in range(count)], *operands)


def _halving_exchange(tree: _Tree, bufs: list[jax.Array], low: jax.Array, s: int) -> Any:
    """Level ``s``'s halves: (kept, received), each zero padded to ``p / 2`` rows."""
    p = tree.p
    half = p >> (s + 1)
    pairs = [(i, i ^ (1 << s)) for i in range(p)] + [(e, e) for e in range(p, tree.n)]
    start = jnp.where(low, 0, half)
    keep = [jax.lax.dynamic_slice_in_dim(x, start, half, axis=0) for x in bufs]
    send = [jax.lax.dynamic_slice_in_dim(x, half - start, half, axis=0) for x in bufs]
    recv = comm.ppermute(send, tree.axis_name, pairs, caller="adasum")
    padded = [[jnp.pad(x, ((0, p // 2 - half), (0, 0))) for x in part] for part in (keep, recv)]
    return padded[0], padded[1]


def _group_exponents(tree: _Tree, local: jax.Array, s: int) -> jax.Array:
    """Per leaf, the largest of level ``s``'s exponents ``local`` ``(2, L)`` over this worker's group."""
    p, idx = tree.p, tree.idx
    num_groups = p >> (s + 1)
    onehot = (jnp.arange(num_groups) == idx >> (s + 1)) & (idx < p)
    slots = jnp.where(onehot[:, None, None], local[None], jnp.full_like(local[None], _NO_EXPONENT))
    group = jnp.minimum(idx >> (s + 1), num_groups - 1)
    return jax.lax.dynamic_index_in_dim(
        comm.pmax(slots, tree.axis_name, caller="adasum"), group, keepdims=False
    )


def _group_dots(tree: _Tree, partial: jax.Array, s: Any) -> jax.Array:
    """The sum over this worker's group of level ``s`` of the partial dot products ``(2, 3, L)``.

    They travel one slot per worker, so the psum adds only zeros to them; the
    group's slots (an aligned block of ``2**(s+1)``) are added pairwise in a
    fixed order, the others set to zero first (adding zeros is exact).
    """
    p, idx = tree.p, tree.idx
    slots = jnp.where((jnp.arange(p) == idx)[:, None, None, None], partial[None], 0.0)
    summed = comm.psum(slots, tree.axis_name, caller="adasum")
    first = jnp.minimum(idx >> (s + 1), (p >> (s + 1)) - 1) << (s + 1)
    rows = jnp.arange(p)
    member = (rows >= first) & (rows < first + (1 << (s + 1)))
    return _sum_two_floats(jnp.where(member[:, None, None, None], summed, 0.0))


def _run_tree(
    leaves: list[jax.Array],
    *,
    axis_name: base.AxisName,
    n: int,
    method: str,
) -> list[jax.Array]:
    """AdaSum of ``leaves`` over the workers; the result is replicated (invariant)."""
    p = _power_of_two_below(n)
    rounds = p.bit_length() - 1
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    layouts = [_Layout([leaves[i] for i in ids], p) for ids in groups.values()]
    bufs = [lay.pack([leaves[i] for i in ids]) for lay, ids in zip(layouts, groups.values())]
    bufs = comm.to_varying(bufs, axis_name)
    tree = _Tree(layouts, axis_name, n, p, comm.axis_index(axis_name, caller="adasum"))
    if method == "butterfly":
        bufs = _butterfly(tree, bufs)
        # Every primary worker holds all of the result, the same bits on each.
        rows = [jax.lax.dynamic_index_in_dim(x, jnp.minimum(tree.idx, p - 1), keepdims=False) for x in bufs]
        order = np.arange(p)
    else:
        if n > p:  # the fold, as the butterfly's first level
            fold, first, keep = _butterfly_levels(n, p)[0]
            recv = comm.ppermute(bufs, axis_name, fold, caller="adasum")
            folded = tree.pair(bufs, recv, jnp.asarray(first)[tree.idx])
            bufs = [jnp.where(jnp.asarray(keep)[tree.idx], x, y) for x, y in zip(folded, bufs)]
        if rounds:
            bufs = _halving(tree, bufs)
        # Every primary worker holds the 1/p slice of rows it owns.
        rows = [x[0] for x in bufs]
        order = np.array([_bit_reverse(i, rounds) for i in range(p)], dtype=np.int32)
    # An all-gather of one row per worker assembles the result, typed replicated.
    gathered = comm.all_gather(rows, axis_name, caller="adasum")
    out: list[Any] = [None] * len(leaves)
    for lay, ids, g in zip(layouts, groups.values(), gathered):
        for i, x in zip(ids, lay.unpack(g[:p][order])):
            out[i] = x
    return out


def adasum(
    *,
    axis_name: base.AxisName = base.DEFAULT_AXIS_NAME,
    method: str = "butterfly",
) -> optax.GradientTransformationExtraArgs:
    r"""Adaptive summation (AdaSum) of the workers' updates, per leaf, for any worker count.

    Each leaf (layer) is combined pairwise up a binary tree over the workers with

    .. math::
      A(a, b) = \Big(1 - \frac{a \cdot b}{2 \|a\|^2}\Big) a
              + \Big(1 - \frac{a \cdot b}{2 \|b\|^2}\Big) b,

    so orthogonal updates add up, equal ones are kept once, and partly
    aligned ones fall in between: a sum where the workers disagree, a mean
    where they agree, which tolerates larger learning rates than the mean at
    scale (Maleki et al. 2020).

    The order in the chain says what is combined (MindSpore's two wrappers):

    * ``optax.chain(adasum(), sgd(...))`` combines gradients
      (``AdaSumByGradWrapCell``);
    * ``optax.chain(sgd(...), adasum())`` combines each worker's local
      optimizer step (``AdaSumByDeltaWeightWrapCell``); the local
      optimizer's state is then per-worker. No second copy of the model is
      kept (Horovod keeps one).
    * ``optax.chain(all_reduce(axis_name="local"), adasum(axis_name="node"))``
      on a 2-D mesh is hierarchical AdaSum: a mean inside each node, AdaSum
      across nodes.

    **Tree order** (any ``n``; :func:`adasum_tree` returns it). With ``p`` the
    largest power of two ``<= n`` and ``r = n - p``, worker ``j < r`` first
    absorbs worker ``p + j`` (``A(x_j, x_{p+j})``); then, for ``s = 0, ...,
    log2 p - 1``, worker ``i < p`` pairs with ``i XOR 2**s``, the lower index
    as the first argument. For ``n = 3`` that is ``A(A(x0, x2), x1)``.

    **Numerics.** Before the dot products, each vector of a pair is divided
    by the power of two that brings its largest entry into [0.5, 1), so its
    squared norm lies in [0.25, size]: the dot products cannot underflow or
    overflow, whether the entries are subnormal or near the dtype's maximum,
    and however far apart the two vectors' magnitudes are. The pair sum is
    formed at the scale of the larger vector and scaled back at the end. The
    scalings work on the bits of the floats (exact, one rounding where a
    result lands among the subnormals), because XLA:CPU flushes subnormal
    float32 operands and results to zero in arithmetic. Dot products are
    taken in at least float32 (the leaf's dtype if wider), also for
    bfloat16/float16 updates, and compensated: each product enters as its
    exact two-float (Dekker's product, the halves split on the bits) and the
    sums run as two-floats (Ogita, Rump and Oishi's ``Dot2``), accurate to
    about twice the working precision, as Horovod's float64 sums; the three
    sums of a pair share one order. The ratios ``a.b / 2|.|^2`` and the
    coefficients ``1 - ratio`` are two-floats too, and the pair sum
    ``c_a a + c_b b`` is formed from exact products and rounded once: one
    rounding per pair, as Horovod's float64 arithmetic. No float64 is used
    (nor needed: x64 may stay off), and the compensation is unaffected by a
    compiler that fuses multiply-adds. The combination is cast back to the
    leaf's dtype; vectors travel in the leaf's dtype. A zero vector
    contributes nothing (the pair sum is the other vector). Outputs are
    bit-identical on every worker. Horovod's acceptance cases (orthogonal,
    parallel, stability, stability_2, with its draws) pass with its
    criterion in float32 and float16 on 2, 4 and 8 workers, against the sum
    or mean it expects and against the exact AdaSum of the rounded inputs.
    In ``stability`` the pair results travel in the leaf's dtype at
    subnormal magnitudes (rounded to the subnormal grid at each level of
    the tree), so draws whose columns nearly cancel in the mean can miss its
    criterion (by up to 10x in float32 on 4 and 8 workers).

    Args:
      axis_name: the mapped axis (or tuple of axes, under shard_map) to
        combine over.
      method: ``"butterfly"``: recursive doubling; every worker exchanges its
        whole vector at each of the ``log2 p`` rounds and computes the pair
        sum itself. ``"halving"``: recursive halving as in MindSpore; at
        each round a worker keeps half of its current rows, sends the other
        half, and the three dot products are summed over the group sharing
        the pair; bandwidth-optimal (about twice the vector per worker in
        total instead of ``log2 p`` times).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with an empty state.

    Communication:
      With ``N`` the bytes of the updates (each leaf padded to a multiple of
      ``p``) and ``n`` workers, ``p`` the largest power of two ``<= n``:

      * ``n`` not a power of two: one ppermute of ``N`` (the fold; the
        ``p`` workers without a partner send to themselves).
      * ``"butterfly"``: ``log2 p`` ppermutes of ``N`` each.
      * ``"halving"``: ``log2 p`` ppermutes of ``N/2, N/4, ..., N/p``,
        ``log2 p`` psums of ``2 x 3 x leaves x p`` float32s (each worker's
        partial dot products as two-floats, in a slot of its own, so that
        the sum over a group is formed exactly the same on its members),
        and ``log2 p`` pmaxes of ``2 x leaves x p/2**(s+1)`` int32 exponents
        (the scale of each vector over the rows the group holds).
      * Both: one all-gather in which every worker sends ``N/p`` (receives
        ``(n-1) N/p``). The ppermute results already agree bit for bit, but
        shard_map types them per-worker; this gather (which stands in for
        the second, recursive-doubling half of the halving scheme) delivers
        the result typed replicated, and sends it back to the folded workers.

      All leaves of one dtype travel in one buffer, so the collective count
      does not grow with the number of leaves. Output updates are
      replicated. No state.

    Compilation:
      The arithmetic runs on whole buffers, one operation per set of leaves
      of equal size (per-leaf scalars broadcast, per-leaf sums batched), and
      the levels of the tree run in one loop: the program does not grow with
      the number of leaves, and with the number of workers only by the
      exchanges of each level. ``"halving"`` computes every level on ``p / 2``
      rows, the rows it does not hold zero, so its arithmetic is at most
      ``log2(p) / 2`` times what it holds (fewer than ``"butterfly"``'s
      ``log2 p`` whole buffers); its bytes are unchanged.

    Sharded parameters:
      Needs whole leaves: the coefficients come from each leaf's dot product,
      squared norms and largest magnitude, and the leaves travel packed in one
      buffer per dtype; the compiler computes those reductions and moves the
      buffer's pieces over the model axes. The exchanges above run over the
      data axis, per replica; the output is that of replicated parameters, to
      float rounding of the dot products.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxopt_dist as jd
      >>> from jaxopt_dist._src.adasum import adasum
      >>> tx = adasum()
      >>> grads = jnp.array([[1.0, 0.0], [0.0, 2.0]])  # 2 workers, orthogonal
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="data")(grads)[0]
      Array([1., 2.], dtype=float32)

    References:
      Maleki et al., `Scaling Distributed Training with Adaptive Summation
      <https://arxiv.org/abs/2006.02924>`_, 2021
    """
    axis_name = base.validate_axis_name(axis_name)
    if method not in _METHODS:
        raise ValueError(f"`method` must be one of {_METHODS}; got {method!r}.")

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        n = comm.require_axis(axis_name, "adasum")
        comm.per_worker_share(updates, axis_name, linear=False, caller="adasum")  # raises if already summed
        leaves, treedef = jax.tree.flatten(updates)
        for x in leaves:
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"`adasum` combines floating-point updates; got a leaf of dtype {x.dtype}.")
        # Empty leaves carry nothing; constants keep them typed replicated.
        out = [jnp.zeros(x.shape, x.dtype) for x in leaves]
        active = [i for i, x in enumerate(leaves) if x.size]
        if active:
            combined = _run_tree([leaves[i] for i in active], axis_name=axis_name, n=n, method=method)
            for i, x in zip(active, combined):
                out[i] = x
        return jax.tree.unflatten(treedef, out), state

    return comm.float_updates(
        optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn), "adasum"
    )
