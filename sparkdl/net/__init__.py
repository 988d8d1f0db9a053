"""The one network layer under the ring, the parameter server and the relay: authentication, exact I/O, listeners.

=================  ==========================================================================
module             concern
=================  ==========================================================================
``io``             exact reads and writes of byte buffers on a blocking socket, socket tuning
``auth``           the mutual HMAC-SHA256 challenge/response with the per-job secret
``listener``       the hardened accept loop: handshakes on a selector, bounded pending slots
``secure``         the channel after a handshake: plain bytes, or AES-GCM records when Spark encrypts RPC
=================  ==========================================================================
"""
