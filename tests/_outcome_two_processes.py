"""One process of a two-process island (jax.distributed, gloo): a round's outcome, given on the first
process, as ``broadcast.outcome_everywhere`` hands it to both; prints it as JSON (tests/test_islands_broadcast.py).

    python tests/_outcome_two_processes.py HOST:PORT PROCESS_ID
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))

from jaxopt_dist._src.islands import broadcast, merge, wire  # noqa: E402
from jaxopt_dist._src.islands.protocol import Outcome  # noqa: E402

given = None
if jax.process_index() == 0:
    merged = merge.Merged([np.arange(3, dtype=np.float32)], [0, 2], [1.0, 0.0])
    rejected = [wire.Rejected(2, "non-finite"), wire.Rejected(None, "no tag (a secret is required)")]
    given = Outcome(0, merged, None, 5, 1, 0.25, rejected=rejected)
got = broadcast.outcome_everywhere(given, (None, None), lambda state, f: [np.zeros(3, np.float32)], 4)
print(
    json.dumps(
        {
            "fragment": got.fragment,
            "delta": [x.tolist() for x in got.merged.delta],
            "participants": got.merged.participants,
            "weights": got.merged.weights,
            "round": got.round,
            "redone": got.redone,
            "rejected": [[r.island, r.reason] for r in got.rejected],
        }
    ),
    flush=True,
)
