"""``sparkdl.plan``: which mode, batch size and number of workers, from a short probe on the cluster and the cost
model of every communication pattern (``sparkdl.collective.cost``)."""
