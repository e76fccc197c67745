"""Islands: DiLoCo's outer exchange between separately launched JAX jobs that die and rejoin.

* :mod:`.merge`: the merge rules as one SUM all-reduce of a packed
  ``[w * delta, w]`` (host and in-jit).
* :mod:`.transport`: the interface an island needs of the link, and
  :class:`~.transport.LocalHub` (islands as threads of one process).
* :mod:`.island`: :class:`~.island.Island`, the host-side round loop around
  one job's :func:`jaxopt_dist.data_parallel_step`.
* :mod:`.torchft`: the transport over torchft (lighthouse, ``Manager``,
  reconfigurable gloo, HTTP healing); the only module that imports torch.

Floors: this package imports ``training`` and the transforms' ground floor;
nothing below imports it.
"""
