"""Horovod as a backend: its rendezvous inside Spark barrier tasks (:mod:`.rendezvous`) and the ``Communicator``
protocol over its collectives (:mod:`.communicator`)."""

from sparkdl.collective.horovod.communicator import HorovodCommunicator
from sparkdl.collective.horovod.rendezvous import Slot, horovod_environment, interface_of, slot_plan

__all__ = ["HorovodCommunicator", "Slot", "horovod_environment", "interface_of", "slot_plan"]
