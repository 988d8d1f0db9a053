"""The errors every sparkdl link raises: a collective's, a point-to-point message's and the parameter server's alike."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective, a message or a connection between ranks failed; the communicator is unusable."""


class CollectiveTimeout(CollectiveError):
    """A single network wait exceeded the configured timeout."""
