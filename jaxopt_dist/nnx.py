"""Flax NNX models with state under data parallelism: ``from jaxopt_dist import nnx as jnnx``.

Requires flax (``import jaxopt_dist`` alone does not import it). See
:func:`data_parallel` and :class:`Optimizer`.
"""

from jaxopt_dist._src.training.nnx import DataParallel, Optimizer, data_parallel

__all__ = ("DataParallel", "Optimizer", "data_parallel")
