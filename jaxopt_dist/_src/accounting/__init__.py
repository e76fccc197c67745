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
  collectives of compiled HLO text, to check the traced figures against.

Imports go one way: ``walk``, ``projection`` and ``hlo`` import ``costs``,
``walk`` imports ``trace``, and no module imports another's private names.
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
