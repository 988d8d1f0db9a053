"""Comparing two trained Keras models weight by weight: what the tests that fit one mode against another share."""

import numpy as np


def assert_same_weights(got, want, rtol=1e-5, atol=1e-6):
    """``got``'s weights are ``want``'s, every one, to the tolerances."""
    for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
