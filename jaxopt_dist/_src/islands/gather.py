r"""A round's merge from gathered contributions: every island's decoded, combined in island order.

Where a round gathers the members' records (:mod:`.wire`), every member opens
every record, refusing those that fail a check (:class:`~.wire.Rejected`: a tag
missing or wrong under the shared secret, a header that lies about its length,
an island id outside the slots), decodes the accepted contributions with the
aggregate's own decoding (:class:`Exchange`), and combines them in island order
with a :data:`Rule`. Every member holds the same records and makes the same
checks, so every member holds the same merged values, bit for bit.

A :data:`Rule` is ``rule(contributions, like) -> leaves``: ``contributions``
are the round's :class:`Decoded` contributions of non-zero weight in island
order (increasing id), ``like`` the fragment's leaves (shapes and dtypes), and
the result the merged leaves, in ``like``'s dtypes. It runs on the host, on
every member, on the same inputs; to give every member the same bits whatever
its machine, it should use elementwise operations only (NumPy's reductions may
add in another order on another CPU). The islands' own rule is
:func:`weighted_mean`.

A robust ``aggregate`` (:func:`jaxopt_dist.trimmed_mean`,
:func:`jaxopt_dist.coordinate_median`, :func:`jaxopt_dist.centered_clip`,
:func:`jaxopt_dist.norm_clipped_mean`) combines rows instead
(:attr:`Exchange.rows`): each member stacks the contributions in slot order,
one row per slot (``num_slots`` rows), NaN where a slot sent nothing, weighs 0
or was dropped, so that the shapes stay static and one program serves every
quorum; the rule leaves the NaN rows out, as it leaves out a worker with a
NaN in process. Every member runs the same program on the same rows, with
the same aggregate state (the previous round's, for centered clipping), so
every member holds the same merged values and the same new state.

Whatever the rule, a contribution whose decoded values hold a NaN or an
infinity is left out (weight 0) and named in ``rejected`` with the reason
``"non-finite"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxopt_dist._src.islands import merge, wire


class Decoded(NamedTuple):
    """One island's contribution to a round, decoded.

    Attributes:
      island: its id.
      weight: its weight (> 0).
      values: its values, one array per leaf of the fragment (what the
        aggregate's mean averages).
      support: None, or per leaf 1 where the contribution holds the entry
        and 0 where it does not (an aggregate whose entries are each averaged
        over the islands that sent them: SparseLoCo's chunked top-k).
    """

    island: int
    weight: float
    values: list[np.ndarray]
    support: list[np.ndarray] | None


Rule = Callable[[Sequence[Decoded], Sequence[Any]], list[np.ndarray]]
"""``rule(contributions, like) -> merged leaves``; see the module."""

Rows = Callable[[list[np.ndarray], Any], tuple[list[Any], Any]]
"""``rows(stacked, state) -> (merged leaves, new state)``: a robust rule over one row per slot."""

NON_FINITE = "non-finite"
"""The reason given in ``rejected`` for a contribution with a NaN or an infinity."""


def weighted_mean(contributions: Sequence[Decoded], like: Sequence[Any]) -> list[np.ndarray]:
    r"""``sum_i w_i v_i / sum_i w_i`` per entry, the sums over the contributions in their order.

    Where contributions carry a support, each entry's sums run over those
    that hold it (0 where none does): ``sum_i w_i s_i v_i / sum_i w_i s_i``.
    In float32, elementwise: the same bits on every machine.
    """
    out = []
    for j, x in enumerate(like):
        shape = tuple(np.shape(x))
        num = np.zeros(shape, np.float32)
        den = np.zeros(shape if any(c.support is not None for c in contributions) else (), np.float32)
        for c in contributions:
            w = np.float32(c.weight)
            num = num + w * np.asarray(c.values[j], np.float32)
            den = den + (w if c.support is None else w * np.asarray(c.support[j], np.float32))
        merged = np.where(den > 0, num / np.where(den > 0, den, np.float32(1)), np.float32(0))
        out.append(np.asarray(merged, np.float32).astype(np.dtype(x.dtype)))
    return out


@dataclasses.dataclass
class Exchange:
    """How one island gathers its rounds (see the module).

    Attributes:
      secret: the islands' shared secret, or None.
      layouts: per fragment (-1: a join, nothing), the layout of its message.
      decode: ``decode(fragment, message, state) -> (values, support)``, the
        aggregate's decoding of one island's message (host arrays), given
        this island's aggregate state of the fragment before the round.
      like: per fragment, its leaves' shapes and dtypes.
      rule: the :data:`Rule` combining the decoded contributions.
      rows: None, or the :data:`Rows` rule of a robust aggregate (then
        ``rule`` is not used): it gets the contributions stacked in slot
        order (see the module) and this island's aggregate state of the
        fragment before the round, and gives the merged leaves and the
        aggregate's new state.
    """

    secret: bytes | None
    layouts: dict[int, wire.Layout]
    decode: Callable[[int, list[np.ndarray], Any], tuple[list[Any], list[Any] | None]]
    like: dict[int, list[Any]]
    rule: Rule = weighted_mean
    rows: Rows | None = None

    @property
    def size(self) -> int:
        """The length of every record of the run."""
        return wire.record_size(list(self.layouts.values()))

    def seal(self, h: wire.Header, message: Sequence[np.ndarray]) -> np.ndarray:
        """This island's record of a round."""
        layout = wire.Layout(()) if h.weight == 0 else self.layouts[h.fragment]
        return wire.seal(
            h._replace(layout=layout.tag), message if h.weight else [], size=self.size, secret=self.secret
        )


class Gathered(NamedTuple):
    """A gathered round: the merged round, the records refused or left out, and (for a :data:`Rows` rule)
    the aggregate's new state of the fragment (None: the island keeps its own)."""

    merged: merge.Merged
    rejected: list[wire.Rejected]
    state: Any = None


def combine(
    records: Sequence[np.ndarray], ex: Exchange, fragment: int, *, num_slots: int, state: Any = None
) -> Gathered:
    """The round from the members' ``records``: each opened and checked, the accepted decoded (those with a
    NaN or an infinity left out, weight 0) and combined in island order with ``ex.rule`` or ``ex.rows``
    (the merged leaves of ``fragment``, this island's), the slot table read off their headers as
    :func:`.merge.unpack` reads it off a summed buffer."""
    accepted, rejected = _opened(records, ex, num_slots)
    like = ex.like.get(fragment, [])
    decoded: list[Decoded] = []
    dropped: set[int] = set()
    for o in accepted:
        if o.header.fragment != fragment or o.header.weight <= 0 or not like:
            continue
        d = Decoded(o.header.island, o.header.weight, *_host(ex.decode(fragment, o.message, state)))
        if all(np.all(np.isfinite(v)) for v in d.values):
            decoded.append(d)
        else:  # left out: its row stays NaN, and its weight in the table is 0
            dropped.add(o.header.island)
            rejected.append(wire.Rejected(o.header.island, NON_FINITE))
    table = np.zeros(merge.tail_size(num_slots), np.float32)
    for o in accepted:
        h = o.header._replace(weight=0.0) if o.header.island in dropped else o.header
        try:
            table += merge.pack(
                [], h.weight, slot=h.island, num_slots=num_slots, round=h.round, anchor=h.anchor,
                behind=h.healed, joined=h.joined, nonce=h.nonce, settings=h.settings, fragment=h.fragment,
            )  # fmt: skip
        except ValueError as e:
            rejected.append(wire.Rejected(h.island, f"its header is out of range: {e}"))
    delta, new_state = [], None
    if like and ex.rows is not None:
        delta, new_state = ex.rows(stacked_rows(decoded, like, num_slots), state)
        delta = [np.asarray(d).astype(np.dtype(x.dtype)) for d, x in zip(delta, like)]
    elif like:
        delta = ex.rule(decoded, like)
    return Gathered(merge.unpack(table, [], num_slots=num_slots)._replace(delta=delta), rejected, new_state)


def _opened(records: Sequence[np.ndarray], ex: Exchange, num_slots: int) -> tuple[list[Any], list[Any]]:
    """The records opened: those accepted that do not abstain, in island order, and those refused."""
    accepted, rejected = [], []
    for record in records:
        got = wire.open_record(record, layouts=ex.layouts, secret=ex.secret)
        if isinstance(got, wire.Opened) and not 0 <= got.header.island < num_slots:
            got = wire.Rejected(got.header.island, f"its island id is outside [0, {num_slots})")
        if isinstance(got, wire.Rejected):
            rejected.append(got)
        elif not got.header.abstains:
            accepted.append(got)
    accepted.sort(key=lambda o: o.header.island)
    return accepted, rejected


def stacked_rows(contributions: Sequence[Decoded], like: Sequence[Any], num_slots: int) -> list[np.ndarray]:
    """Per leaf, the contributions' values stacked in slot order: ``(num_slots, *shape)`` in the leaf's
    dtype, row ``i`` island ``i``'s, NaN where no contribution of weight above 0 came from slot ``i``."""
    out = []
    for j, x in enumerate(like):
        rows = np.full((num_slots, *np.shape(x)), np.nan, np.dtype(x.dtype))
        for c in contributions:
            if c.weight > 0:
                rows[c.island] = np.asarray(c.values[j]).astype(rows.dtype)
        out.append(rows)
    return out


def _host(decoded: tuple[Any, Any]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    values, support = decoded
    return [np.asarray(v) for v in values], None if support is None else [np.asarray(x) for x in support]
