"""A SIGTERM that lands inside library cleanup still counts as the interrupt it was."""

from __future__ import annotations

import pytest

from compress.base.errors import interruption
from compress.base.signals import Terminated


def test_an_error_raised_while_the_interrupt_propagated_is_traced_back_to_it():
    with pytest.raises(AttributeError) as caught:
        try:
            raise Terminated("terminated by signal 15")
        finally:
            None._invalidate_flags_cache()  # what omegaconf's cleanup did when the signal landed inside it
    assert isinstance(interruption(caught.value), Terminated)
    assert interruption(ValueError("plain failure")) is None
