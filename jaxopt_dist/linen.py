"""Flax linen ``TrainState`` steps under data parallelism: ``from jaxopt_dist import linen as jlinen``.

Requires flax (``import jaxopt_dist`` alone does not import it). See
:func:`data_parallel` and :class:`TrainState`.
"""

from jaxopt_dist._src.training.linen import DataParallelTrainState, TrainState, data_parallel

__all__ = ("DataParallelTrainState", "TrainState", "data_parallel")
