"""Islands: DiLoCo's outer exchange between separately launched JAX jobs that die and rejoin.

As torchft splits its ``Manager``, process group and checkpoint transport:

* :mod:`.island`: :class:`~.island.Island`, the orchestration around one
  job's :func:`jaxopt_dist.data_parallel_step`: when a round launches, what it
  brings, when its result lands.
* :mod:`.protocol`: a round's attempts (quorum, one all-reduce, the members'
  checks of the summed buffer, a commit vote), with backoff and a bound.
* :mod:`.merge`: the merge rules as one SUM all-reduce of a packed
  ``[w * delta, w]`` (host and in-jit), and the buffer's per-slot tail.
* :mod:`.healing`: what an island serves a lagging peer, and how it takes a
  state it healed to; :mod:`.heal_http`: that state over HTTP, raw arrays
  under a JSON header, no pickle.
* :mod:`.landing`: the island's own programs, and a committed round written
  into the state.
* :mod:`.broadcast`: an island of several processes: values to the host, and
  a round's outcome on every process.
* :mod:`.transport`: the interface an island needs of the link;
  :mod:`.local`: :class:`~.local.LocalHub` (islands as threads of one
  process, failing as processes and sockets do); :mod:`.torchft`: the
  transport over torchft (lighthouse, ``Manager``, reconfigurable gloo), the
  only module that imports torch.

Floors: this package imports ``training`` and the transforms' ground floor;
nothing below imports it.
"""
