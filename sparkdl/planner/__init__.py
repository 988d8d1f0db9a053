"""``sparkdl.plan``: which mode, batch size and number of workers, from a short probe on the cluster and the cost
of each planned mode's communication (:mod:`.mode_costs`, built on ``sparkdl.collective.cost``)."""
