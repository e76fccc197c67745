"""What differs between the JAX releases jaxopt_dist supports (0.10 to 0.12), in one place.

Everything else in the package uses the public API that all of them share. The
differences that matter here:

* Mesh axes default to ``AxisType.Explicit``: ``jax.make_mesh``'s in every
  supported release (0.10 included), ``AbstractMesh``'s from JAX 0.11 (``Auto``
  in 0.10). Under Explicit axes, ``shard_map``
  checks each input's sharding against its ``in_spec``, so abstract inputs must
  carry a sharding (``jax.ShapeDtypeStruct(..., sharding=...)``, which every
  supported release accepts), and compiled HLO names replica groups
  by mesh axes (``replica_groups=mesh['data'=8] {'data'}``; parsed in ``accounting``).
* The ``scan`` primitive's parameters: ``num_consts``/``num_carry`` until 0.10,
  a flat-tree description ``ft_in = (consts, carry, xs)`` from 0.11
  (:func:`scan_num_consts`).
"""

from __future__ import annotations

from typing import Any

import jax


def scan_num_consts(eqn: Any) -> int:
    """The number of leading operands of a ``scan`` equation that are loop constants."""
    return scan_operand_counts(eqn)[0]


def scan_operand_counts(eqn: Any) -> tuple[int, int]:
    """``(constants, carries)``: how many of a ``scan`` equation's leading operands are each."""
    params = eqn.params
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    # JAX >= 0.11: ``ft_in`` is a flat tree (consts, carry, xs) whose parts list their leaves.
    parts = getattr(params.get("ft_in"), "elts", None)
    if parts is not None and len(parts) == 3:
        sizes = [len(list(getattr(part, "vals", ()))) for part in parts]
        if sum(sizes) == len(eqn.invars):
            return sizes[0], sizes[1]
    raise NotImplementedError(
        "jaxopt_dist cannot read this JAX version's scan parameters "
        f"(jax {jax.__version__}: {sorted(params)}); please report it."
    )
