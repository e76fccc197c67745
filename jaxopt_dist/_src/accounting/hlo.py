"""The collectives of compiled HLO text, to check the traced accounting against.

:func:`hlo_collectives` reads ``jax.jit(f).lower(...).compile().as_text()``
line by line and returns an :class:`HloCollective` (priced like a traced
collective, by :func:`jaxopt_dist._src.accounting.costs.factors`) for each
collective op.

Replica groups. The devices of each group are read from the three forms XLA
prints: explicit lists ``replica_groups={{0,4},{1,5},{2,6},{3,7}}``; iota
lists ``replica_groups=[2,4]<=[8]`` (``G`` groups of ``S``: ``iota(8)``
reshaped to ``[2,4]``), optionally reshaped and transposed first,
``[4,2]<=[2,4]T(1,0)``; and mesh axes (XLA with JAX >= 0.11),
``replica_groups=mesh['data'=2,'fsdp'=4] {'data'}``: one group per position
on the axes not named, holding the devices along the named ones (sub-axes
``'fsdp':(1)2`` and a ``device_ids=(...)`` order included). Permutes take
their ``source_target_pairs`` as groups of two. The numbers are the
program's *logical* device ids: positions in its device assignment, which
for a program compiled on a ``jax.sharding.Mesh`` is ``mesh.devices.flat``
(not ``device.id``: the same text comes out for any order of the devices).
Given that mesh, :func:`hlo_collectives` names the mesh axes each collective
spans (:func:`mesh_axes_of`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from jaxopt_dist._src.accounting import costs

_HLO_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?P<start>-start)?\("
)
_HLO_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_HLO_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_HLO_KIND = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "collective-permute": "permute",
    "all-to-all": "all_to_all",
    "reduce-scatter": "reduce_scatter",
}

Shapes = list[tuple[tuple[int, ...], str]]  # (shape, hlo dtype) of each operand
Groups = tuple[tuple[int, ...], ...]  # logical device ids of each replica group


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """A collective op of compiled HLO text (see :func:`hlo_collectives`).

    Attributes:
      kind: one of :data:`KINDS`.
      op: the HLO opcode.
      computation: the HLO computation it sits in (conditional branches and
        loop bodies are computations of their own).
      group_size: workers per replica group (0 if the text does not say).
      operands: ``(shape, hlo dtype)`` of each local operand.
      moving: for permutes, the fraction of workers that send.
      groups: the logical device ids of each replica group (for permutes,
        each source-target pair); empty where the text lists none (one
        group of every device); None where its form was not recognised.
      axes: the mesh axes the groups span, in the mesh's order, when
        :func:`hlo_collectives` was given the mesh (None where the groups
        were not read); else empty.
    """

    kind: str
    op: str
    computation: str
    group_size: int
    operands: tuple[tuple[tuple[int, ...], str], ...]
    moving: float = 1.0
    groups: Groups | None = ()
    axes: tuple[Any, ...] | None = ()

    @property
    def payload_elements(self) -> int:
        return int(sum(math.prod(s) for s, _ in self.operands))

    @property
    def payload_bytes(self) -> int:
        return int(sum(math.prod(s) * _HLO_ITEMSIZE.get(d, 4) for s, d in self.operands))

    def sent_bytes(self) -> float:
        return costs.factors(self.kind, self.group_size, self.moving)[0] * self.payload_bytes


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


_IOTA = r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?"  # iota(prod(dims)) reshaped to dims, maybe transposed


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """The flat ids of ``[dims]T(perm)``: ``iota`` reshaped to ``dims``, transposed by ``perm``."""
    shape = _ints(dims)
    ids = np.arange(math.prod(shape)).reshape(shape)
    return (ids.transpose(_ints(perm)) if perm else ids).reshape(-1)


def _iota_groups(line: str) -> Groups | None:
    """``[G,S]<=[d0,d1,...]`` with an optional ``T(perm)``: ``iota`` reshaped, transposed, regrouped."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=" + _IOTA, line)
    if not m:
        return None
    ids = _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
    return tuple(tuple(int(i) for i in g) for g in ids)


def _device_ids(text: str | None, n: int) -> np.ndarray | None:
    """A mesh's ``device_ids=(...)``: an iota form ``[2,4]T(1,0)`` or a list; ``iota(n)`` if absent."""
    if text is None:
        return np.arange(n)
    m = re.fullmatch(_IOTA, text.strip())
    ids = _iota(m.group(1), m.group(2)) if m else np.asarray(_ints(text))
    return ids if ids.size == n else None


def _mesh_factors(size: int, refs: list[tuple[int, int] | None]) -> tuple[list[int], list[bool]]:
    """One mesh axis of ``size`` split major to minor at the bounds of its sub-axis ``refs``
    (``(pre_size, size)``; None is the whole axis): the factors and which are grouped."""
    bounds = {1, size}
    for ref in refs:
        if ref is not None:
            bounds.update((ref[0], ref[0] * ref[1]))
    edges = sorted(bounds)
    factors = [b // a for a, b in zip(edges, edges[1:])]
    grouped = [any(ref is None or ref[0] <= a < ref[0] * ref[1] for ref in refs) for a in edges[:-1]]
    return factors, grouped


def _mesh_groups(line: str) -> Groups | None:
    """``mesh['a'=2,'b'=4] {'b'}`` (optionally ``, device_ids=(...)`` and sub-axes ``'b':(1)2``)."""
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}", line
    )
    if not m:
        return None
    names_sizes = re.findall(r"'?([^',=\s]+)'?=(\d+)", m.group(1))
    sizes = {name: int(size) for name, size in names_sizes}
    refs: dict[str, list[tuple[int, int] | None]] = {name: [] for name in sizes}
    for name, pre, sub in re.findall(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?", m.group(3)):
        if name not in refs:
            return None
        refs[name].append((int(pre), int(sub)) if pre else None)
    ids = _device_ids(m.group(2), math.prod(sizes.values()))
    if ids is None:
        return None
    dims: list[int] = []
    grouped: list[bool] = []
    for name, size in sizes.items():
        f, g = _mesh_factors(size, refs[name])
        dims, grouped = dims + f, grouped + g
    order = [i for i, g in enumerate(grouped) if not g] + [i for i, g in enumerate(grouped) if g]
    group_size = math.prod(d for d, g in zip(dims, grouped) if g)
    regrouped = ids.reshape(dims).transpose(order).reshape(-1, group_size)
    return tuple(tuple(int(i) for i in g) for g in regrouped)


def replica_groups(line: str) -> Groups | None:
    """The logical device ids of each replica group of one HLO instruction (any of the three forms).

    For a ``collective-permute``, each source-target pair. Empty when the
    line lists none (no ``replica_groups``, or ``replica_groups={}``: one
    group of every device); None for a form not recognised.
    """
    if "source_target_pairs=" in line:
        pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[-1])
        return tuple((int(a), int(b)) for a, b in pairs)
    if "replica_groups=" not in line:
        return ()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m:
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    return _iota_groups(line) or _mesh_groups(line)


def mesh_axes_of(groups: Groups | None, mesh: Any) -> tuple[Any, ...] | None:
    """The axes of ``mesh`` along which the devices of some group differ, in the mesh's order.

    ``groups`` holds logical device ids (positions in ``mesh.devices.flat``,
    see the module docstring). Empty groups mean one group of every device;
    None (groups not read), or an id beyond the mesh's devices, gives None.
    """
    shape = tuple(np.shape(mesh.devices))
    names = tuple(mesh.axis_names)
    n = math.prod(shape)
    if groups is None or any(i >= n for group in groups for i in group):
        return None
    if not groups:
        return tuple(a for a, s in zip(names, shape) if s > 1)
    varying: set[int] = set()
    for group in groups:
        coords = np.unravel_index(np.asarray(group, dtype=np.int64), shape)
        varying.update(d for d in range(len(shape)) if len(set(coords[d].tolist())) > 1)
    return tuple(names[d] for d in sorted(varying))


def _result_shapes(m: re.Match[str]) -> Shapes:
    """The array shapes in an op's result type; for ``-start`` forms only the operand half."""
    shapes = [
        (tuple(int(d) for d in a.group("dims").split(",") if d), a.group("dtype"))
        for a in _HLO_ARRAY.finditer(m.group("shape"))
    ]
    shapes = [s for s in shapes if s[1] in _HLO_ITEMSIZE]
    if m.group("start") and m.group("op") != "all-reduce":
        # (operands..., results..., [contexts]): keep the operand half.
        shapes = shapes[: max(1, len([s for s in shapes if s[0]]) // 2)]
    return shapes


def _local_shapes(op: str, shapes: Shapes, k: int, line: str) -> Shapes:
    """The operand shapes from the result shapes: all-gather divides, reduce-scatter multiplies."""
    if op not in ("all-gather", "reduce-scatter") or not k:
        return shapes
    dim_m = re.search(r"dimensions=\{(\d+)\}", line)
    dim = int(dim_m.group(1)) if dim_m else 0

    def local(n: int) -> int:
        return n // k if op == "all-gather" else n * k

    return [(s[:dim] + (local(s[dim]),) + s[dim + 1 :], d) if s else (s, d) for s, d in shapes]


def _parse_op(m: re.Match[str], line: str, computation: str) -> HloCollective:
    op = m.group("op")
    groups = replica_groups(line)
    k = len(groups[0]) if groups else 0
    shapes = _local_shapes(op, _result_shapes(m), k, line)
    moving = 1.0
    if op == "collective-permute":
        pairs = groups or ()
        k = len(pairs)
        moving = sum(1 for a, b in pairs if a != b) / k if k else 0.0
    started = op + (m.group("start") or "")
    return HloCollective(_HLO_KIND[op], started, computation, k, tuple(shapes), moving, groups)


def hlo_collectives(hlo_text: str, *, mesh: Any = None) -> list[HloCollective]:
    """The collectives of compiled HLO text, with their local operand shapes.

    Reads the result shape of each ``all-reduce``, ``all-gather``,
    ``collective-permute``, ``all-to-all`` and ``reduce-scatter`` (and their
    ``-start`` forms) and derives the operand: the same for all-reduce,
    all-to-all and permutes, the result divided by the group size for
    all-gather, multiplied for reduce-scatter. Use it on
    ``jax.jit(f).lower(...).compile().as_text()``.

    Note that XLA:CPU runs all-reduces of 16-bit floats in float32 (the
    reduction is "promoted"), so a bf16 all-reduce shows up here as f32.

    With ``mesh`` (the ``jax.sharding.Mesh`` the program was compiled on),
    each collective's ``axes`` names the mesh axes its groups span
    (:func:`mesh_axes_of`): ``("fsdp",)`` for groups of the devices of one
    replica, ``("data",)`` for groups across replicas.

    Sizes are per device: each op's operands are one device's shards.
    """
    out: list[HloCollective] = []
    computation = ""
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{"):
            header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)", line)
            if header:
                computation = header.group(1)
            continue
        m = _HLO_OP.match(line)
        if m:
            out.append(_parse_op(m, line, computation))
    if mesh is not None:
        out = [dataclasses.replace(h, axes=mesh_axes_of(h.groups, mesh)) for h in out]
    return out
