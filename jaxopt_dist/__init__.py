"""jaxopt_dist: communication-efficient data-parallel training as optax transforms.

Every optimizer, aggregation and compression scheme is an
``optax.GradientTransformationExtraArgs`` that talks to other workers only
through ``jax.lax`` collectives on a named axis (``"data"`` by default), so one
code path runs under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)``.
"""

from jaxopt_dist._src import base as _base
from jaxopt_dist._src.accounting import (
    CommunicationCost,
    StepTime,
    communication_cost,
    hlo_collectives,
    project_step_time,
)
from jaxopt_dist._src.accumulate import AccumulateState, accumulate
from jaxopt_dist._src.adasum import adasum, adasum_tree
from jaxopt_dist._src.aggregate import AverageParamsState, all_reduce, average_params, partition_leaves
from jaxopt_dist._src.averaging import IterateAverageState, averaged_params, iterate_average
from jaxopt_dist._src.base import DEFAULT_AXIS_NAME, AxisName
from jaxopt_dist._src.choco import ChocoGossipState, choco_gossip
from jaxopt_dist._src.comm import AlreadyReducedError, Platform, UnboundAxisError, use_platform
from jaxopt_dist._src.decoupled_momentum import DecoupledMomentumState, decoupled_momentum
from jaxopt_dist._src.desloc import DesLocAdamState, desloc_adam
from jaxopt_dist._src.diloco import DiLoCoState, DiLoCoTransformation, OuterExchange, diloco, diloco_fragments
from jaxopt_dist._src.dimreduce import DimReduceInfo, DimReduceState, dim_reduce, fit_subspace, flatten_params
from jaxopt_dist._src.dion import DionState, dion, dion_leaves, scale_by_dion
from jaxopt_dist._src.dion2 import Dion2State, dion2
from jaxopt_dist._src.error_feedback import Codec, Compressor, ErrorFeedbackState, error_feedback
from jaxopt_dist._src.gossip import GossipState, gossip, mixing_matrix, spectral_gap
from jaxopt_dist._src.hierarchical import HierarchicalState, hierarchical
from jaxopt_dist._src.lowbit import float_grid, low_bit
from jaxopt_dist._src.muon import ScaleByMuonState, muon, scale_by_muon
from jaxopt_dist._src.noloco import NoLoCoState, noloco, noloco_groups
from jaxopt_dist._src.onebit_adam import OnebitAdamState, onebit_adam
from jaxopt_dist._src.optimizers import (
    AdamState,
    RmspropState,
    ScaleByAdagradState,
    ScaleByMomentumState,
    adagrad,
    adam,
    rmsprop,
    scale_by_momentum,
    sgd,
    sign_sgd,
)
from jaxopt_dist._src.powersgd import PowerSGDState, compressed_leaves, powersgd
from jaxopt_dist._src.precision import (
    ApplyIfFiniteEverywhereState,
    DynamicLossScaleState,
    MasterWeightsState,
    apply_if_finite_everywhere,
    dynamic_loss_scale,
    loss_scale,
    master_weights,
)
from jaxopt_dist._src.quantize import QSGDState, qsgd, scaled_sign, sign_majority_vote
from jaxopt_dist._src.robust import (
    CenteredClipState,
    centered_clip,
    coordinate_median,
    norm_clipped_mean,
    trimmed_mean,
)
from jaxopt_dist._src.sparseloco import (
    ChunkedTopKState,
    StatisticalQuantizeState,
    chunked_top_k,
    sparseloco,
    statistical_quantize,
)
from jaxopt_dist._src.sparsify import (
    BlockKState,
    RandomKState,
    ThresholdState,
    block_k,
    random_k,
    threshold,
    top_k,
)
from jaxopt_dist._src.training.elastic import reshard_opt_state, reshard_params
from jaxopt_dist._src.training.overlap import OverlappedStep, overlapped_step
from jaxopt_dist._src.training.placement import Placement, opt_state_placement, opt_state_specs
from jaxopt_dist._src.training.step import (
    DataParallelStep,
    data_parallel_step,
    init_opt_state,
    place_opt_state,
    place_params,
)
from jaxopt_dist._src.wrappers import mean_value
from jaxopt_dist._src.zero_one_adam import ZeroOneAdamState, zero_one_adam

__version__ = "0.1.0"

__all__ = (
    "DEFAULT_AXIS_NAME",
    "AccumulateState",
    "AdamState",
    "AlreadyReducedError",
    "ApplyIfFiniteEverywhereState",
    "AverageParamsState",
    "AxisName",
    "BlockKState",
    "CenteredClipState",
    "ChocoGossipState",
    "Codec",
    "CommunicationCost",
    "Compressor",
    "DataParallelStep",
    "OverlappedStep",
    "OuterExchange",
    "DecoupledMomentumState",
    "DiLoCoState",
    "DiLoCoTransformation",
    "ChunkedTopKState",
    "DesLocAdamState",
    "DimReduceInfo",
    "DimReduceState",
    "DionState",
    "Dion2State",
    "DynamicLossScaleState",
    "ErrorFeedbackState",
    "GossipState",
    "HierarchicalState",
    "IterateAverageState",
    "MasterWeightsState",
    "NoLoCoState",
    "ScaleByMuonState",
    "OnebitAdamState",
    "Placement",
    "Platform",
    "PowerSGDState",
    "QSGDState",
    "RandomKState",
    "RmspropState",
    "ScaleByAdagradState",
    "ScaleByMomentumState",
    "StatisticalQuantizeState",
    "StepTime",
    "ThresholdState",
    "UnboundAxisError",
    "ZeroOneAdamState",
    "accumulate",
    "adagrad",
    "adam",
    "adasum",
    "adasum_tree",
    "all_reduce",
    "apply_if_finite_everywhere",
    "average_params",
    "averaged_params",
    "block_k",
    "centered_clip",
    "choco_gossip",
    "chunked_top_k",
    "communication_cost",
    "compressed_leaves",
    "coordinate_median",
    "data_parallel_step",
    "overlapped_step",
    "decoupled_momentum",
    "desloc_adam",
    "diloco",
    "diloco_fragments",
    "dim_reduce",
    "dion",
    "dion_leaves",
    "dion2",
    "dynamic_loss_scale",
    "error_feedback",
    "fit_subspace",
    "flatten_params",
    "float_grid",
    "gossip",
    "hierarchical",
    "hlo_collectives",
    "init_opt_state",
    "iterate_average",
    "loss_scale",
    "low_bit",
    "master_weights",
    "mean_value",
    "mixing_matrix",
    "muon",
    "noloco",
    "noloco_groups",
    "norm_clipped_mean",
    "onebit_adam",
    "opt_state_placement",
    "opt_state_specs",
    "partition_leaves",
    "place_opt_state",
    "place_params",
    "powersgd",
    "project_step_time",
    "qsgd",
    "random_k",
    "reshard_opt_state",
    "reshard_params",
    "rmsprop",
    "scale_by_dion",
    "scale_by_momentum",
    "scale_by_muon",
    "scaled_sign",
    "sgd",
    "sign_majority_vote",
    "sign_sgd",
    "sparseloco",
    "spectral_gap",
    "statistical_quantize",
    "threshold",
    "top_k",
    "trimmed_mean",
    "use_platform",
    "zero_one_adam",
)

# Old names of renamed classes, kept for one release. They are not in __all__.
_RENAMED = {"ScaleByAdamState": "AdamState", "ScaleByRmsState": "RmspropState"}


def __getattr__(name: str) -> type:
    if name in _RENAMED:
        new = _RENAMED[name]
        _base.warn_renamed(
            f"jaxopt_dist.{name}", f"jaxopt_dist.{new}", note=f" `optax.{name}` is a different class."
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
