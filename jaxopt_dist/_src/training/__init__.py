"""The training tools: what runs the transforms on a mesh.

The transforms in ``jaxopt_dist/_src/`` are pure optax transformations. This
package is the wing above them that runs them:

* :mod:`.layout`: the stacked layout of per-worker values (worker ``i`` owns
  row ``i`` of a leading axis), its PartitionSpecs and its placement on a mesh.
* :mod:`.placement`: which optimizer-state leaves are per-worker, read off one
  update traced abstractly under ``jax.shard_map(check_vma=True)``.
* :mod:`.runner`: the step runner every step builder shares (compile cache,
  in-flight throttle, the checks of arguments against the mesh).
* :mod:`.step`: :func:`jaxopt_dist.data_parallel_step` and the state
  placement functions.
* :mod:`.replicas`: the per-worker copies of replicated values that the Flax
  front ends make inside a step.
* :mod:`.nnx`, :mod:`.linen`: the Flax NNX and linen front ends (they import
  flax; nothing else here does).
* :mod:`.elastic`: optimizer state regrouped for another number of workers.

Floors: this package imports the transforms' ground floor (``base``,
``comm``) and nothing above it; ``accounting`` imports :mod:`.placement`.
"""
