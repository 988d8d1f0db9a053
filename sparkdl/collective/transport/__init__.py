"""How a communicator's ranks reach each other over TCP: the links among them (:mod:`.mesh`), one link's frames
(:mod:`.link`), and the frames of one call of an operation (:mod:`.transfer`)."""
