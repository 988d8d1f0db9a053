"""What a communication pattern costs: the latency-bandwidth model, per pattern, and its fit on measured runs.

Every pattern is reduced to four counts (:class:`Cost`) for N ranks and K bytes (the array, or the
model's gradients or weights), and its time to the linear model of Hockney and of Thakur, Rabenseifner
and Gropp ("Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005)::

    T = alpha * steps + beta * link_bytes + gamma * memory_bytes + delta * total_bytes

- ``steps``: the messages on the critical path, one after another (each pays the latency and the
  per-message software cost, ``alpha``);
- ``link_bytes``: the bytes the busiest link carries one after another on the critical path, in one
  direction (links are full duplex: a ring rank's sends and receives overlap; the naive root's gather
  and broadcast do not, as one follows the other); each pays ``beta``, one over the link's bandwidth;
- ``memory_bytes``: the bytes the busiest rank reduces or copies in memory (``gamma``: Thakur's
  per-byte computation cost, here also the copies of a broadcast's result or a shared-memory segment);
- ``total_bytes``: the bytes every rank sends, added up: the traffic the whole network carries. It costs
  nothing where each host has its own links and CPUs (``delta`` = 0, the default); it is what a shared
  resource charges: an oversubscribed fabric's core, or, when every "host" is a namespace of one
  machine (``benchmarks/network_patterns.py``), that machine's CPUs, which move every packet.

``rank_sent`` and ``rank_received`` are the bytes the busiest rank (the root, for a star) sends and
receives per call: what the interface counters of a measured run show. ``messages`` is what the busiest
rank sends per call (a ring sends its chunks in segments of ``algorithms.ring.SEGMENT_BYTES``).

:func:`collective` counts a call of an operation by an algorithm, keyed as the communicator names them
(``collective("allreduce", "ring", n, k)``): each algorithm carries its counts (``Algorithm.costs``, in
its own module of ``sparkdl.collective.algorithms``), so one registered with ``register_algorithm`` is
counted with no other edit; :func:`priced` lists them. The training modes' counts, built on these,
are the planner's (``sparkdl.planner.mode_costs``), each documented with its source; ``model`` holds
the counts and constants. :func:`fit` finds ``alpha``, ``beta``, ``gamma`` and ``delta`` from measured times
(:class:`Measurement`: a pattern's counts and its seconds) by least squares on the relative error
(every size counts alike, 100 KB as much as 256 MB), none negative, any of them pinned to a measured
value; :func:`predict` is the model's time of some counts. Pure Python and numpy, no TensorFlow:
``benchmarks/network_patterns.py`` fits it on emulated networks, docs/patterns.md uses it.
"""

from sparkdl.collective.cost.collectives import collective, priced
from sparkdl.collective.cost.fitting import Measurement, efficiency, fit, predict, relative_error
from sparkdl.collective.cost.model import TERMS, Cost, Params

__all__ = [
    "TERMS",
    "Cost",
    "Measurement",
    "Params",
    "collective",
    "efficiency",
    "fit",
    "predict",
    "priced",
    "relative_error",
]
