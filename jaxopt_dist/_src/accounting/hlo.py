"""The collectives of compiled HLO text, to check the traced accounting against.

:func:`hlo_collectives` reads ``jax.jit(f).lower(...).compile().as_text()``
line by line and returns an :class:`HloCollective` (priced like a traced
collective, by :func:`jaxopt_dist._src.accounting.costs.factors`) for each
collective op.
"""

from __future__ import annotations

import dataclasses
import math
import re

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
    """

    kind: str
    op: str
    computation: str
    group_size: int
    operands: tuple[tuple[tuple[int, ...], str], ...]
    moving: float = 1.0

    @property
    def payload_elements(self) -> int:
        return int(sum(math.prod(s) for s, _ in self.operands))

    @property
    def payload_bytes(self) -> int:
        return int(sum(math.prod(s) * _HLO_ITEMSIZE.get(d, 4) for s, d in self.operands))

    def sent_bytes(self) -> float:
        return costs.factors(self.kind, self.group_size, self.moving)[0] * self.payload_bytes


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    # Mesh-axis groups (XLA with JAX >= 0.11): ``replica_groups=mesh['a'=2,'b'=4] {'b'}``
    # groups the devices over the named axes, so a group holds the product of their sizes.
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']*)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']*)'", m.group(2))
        if axes and all(a in sizes for a in axes):
            return math.prod(int(sizes[a]) for a in axes)
    return 0


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
    k = _group_size(line)
    shapes = _local_shapes(op, _result_shapes(m), k, line)
    moving = 1.0
    if op == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[-1])
        k = k or len(pairs)
        moving = sum(1 for a, b in pairs if a != b) / k if k else 0.0
    started = op + (m.group("start") or "")
    return HloCollective(_HLO_KIND[op], started, computation, k, tuple(shapes), moving)


def hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """The collectives of compiled HLO text, with their local operand shapes.

    Reads the result shape of each ``all-reduce``, ``all-gather``,
    ``collective-permute``, ``all-to-all`` and ``reduce-scatter`` (and their
    ``-start`` forms) and derives the operand: the same for all-reduce,
    all-to-all and permutes, the result divided by the group size for
    all-gather, multiplied for reduce-scatter. Use it on
    ``jax.jit(f).lower(...).compile().as_text()``.

    Note that XLA:CPU runs all-reduces of 16-bit floats in float32 (the
    reduction is "promoted"), so a bf16 all-reduce shows up here as f32.
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
    return out
