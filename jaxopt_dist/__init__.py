"""jaxopt_dist: communication-efficient data-parallel training as optax transforms.

Every optimizer, aggregation and compression scheme is an
``optax.GradientTransformationExtraArgs`` that talks to other workers only
through ``jax.lax`` collectives on a named axis (``"data"`` by default), so one
code path runs under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)``.
"""

from jaxopt_dist._src.aggregate import AverageParamsState, all_reduce, average_params, partition_leaves
from jaxopt_dist._src.base import DEFAULT_AXIS_NAME, AxisName
from jaxopt_dist._src.comm import UnboundAxisError
from jaxopt_dist._src.error_feedback import Compressor, ErrorFeedbackState, error_feedback
from jaxopt_dist._src.optimizers import (
    ScaleByAdagradState,
    ScaleByAdamState,
    ScaleByMomentumState,
    ScaleByRmsState,
    adagrad,
    adam,
    rmsprop,
    scale_by_momentum,
    sgd,
    sign_sgd,
)
from jaxopt_dist._src.parallel import (
    DataParallelStep,
    Placement,
    data_parallel_step,
    init_opt_state,
    opt_state_placement,
    opt_state_specs,
    place_params,
)

__version__ = "0.1.0"

__all__ = (
    "DEFAULT_AXIS_NAME",
    "AverageParamsState",
    "AxisName",
    "Compressor",
    "ErrorFeedbackState",
    "DataParallelStep",
    "Placement",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByMomentumState",
    "ScaleByRmsState",
    "UnboundAxisError",
    "adagrad",
    "adam",
    "all_reduce",
    "average_params",
    "data_parallel_step",
    "error_feedback",
    "init_opt_state",
    "opt_state_placement",
    "opt_state_specs",
    "partition_leaves",
    "place_params",
    "rmsprop",
    "scale_by_momentum",
    "sgd",
    "sign_sgd",
)
