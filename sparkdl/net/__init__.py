"""The one network layer under the ring, the parameter server and the relay: authentication, exact I/O, listeners.

=================  ==========================================================================
module             concern
=================  ==========================================================================
``io``             exact reads and writes of byte buffers on a blocking socket, socket tuning
``auth``           the mutual HMAC-SHA256 challenge/response with the per-job secret
``acceptor``       the hardened accept loop: handshakes on a selector, bounded and evicting
``refusals``       refused connections counted, and logged at a bounded rate
``listener``       authenticated connections served on a bounded number of threads
``secure``         the channel after a handshake: plain bytes, or AES-GCM records when Spark encrypts RPC
=================  ==========================================================================
"""
