"""Communication accounting: what a transform sends, read off its traced update.

One module per concern:

* :mod:`.costs`: the results (:class:`Collective`, :class:`StepCost`,
  :class:`KindCost`, :class:`CommunicationCost`, :data:`KINDS`), the table of
  bytes and latency rounds per collective kind (``factors``), and the one
  spelling of the worker count, ``num_workers`` (with its deprecated aliases).
* :mod:`.trace`: one ``tx.update`` traced under ``jax.shard_map`` on an
  abstract mesh (no devices needed, nothing runs), with the per-worker state
  leaves stacked, and the mesh sizes read from ``num_workers``.
* :mod:`.walk`: :func:`communication_cost`, the jaxpr walker that collects
  the collectives (through ``jit``, ``cond``, ``scan``, ``while``...) and the
  step-by-step simulation of the small replicated state that decides which
  branches run.
* :mod:`.projection`: :func:`project_step_time`, :class:`StepTime` and
  :data:`PROJECTION_ALGORITHMS`: the alpha-beta model in seconds per step.
* :mod:`.hlo`: :class:`HloCollective` and :func:`hlo_collectives`, the
  collectives of compiled HLO text (their replica groups read in each form
  XLA prints, and the mesh axes they span), to check the traced figures
  against.
* :mod:`.sharded`: sharded models (``param_specs``): the model axes, their
  checks, and the collectives the compiler inserts over them, read off the
  update compiled on a mesh (per device; the data axes stay traced, per
  worker).

Imports go one way: ``walk``, ``projection`` and ``hlo`` import ``costs``,
``sharded`` imports ``hlo`` and ``trace``, ``walk`` imports ``trace`` and
``sharded``, and no module imports another's private names.
This file only re-exports.
"""

from jaxopt_dist._src.accounting.costs import KINDS, Collective, CommunicationCost, KindCost, StepCost
from jaxopt_dist._src.accounting.hlo import HloCollective, hlo_collectives
from jaxopt_dist._src.accounting.projection import PROJECTION_ALGORITHMS, StepTime, project_step_time
from jaxopt_dist._src.accounting.walk import communication_cost

__all__ = (
    "KINDS",
    "PROJECTION_ALGORITHMS",
    "Collective",
    "CommunicationCost",
    "HloCollective",
    "KindCost",
    "StepCost",
    "StepTime",
    "communication_cost",
    "hlo_collectives",
    "project_step_time",
)
