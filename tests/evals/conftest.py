"""Fixtures the gate's tests share: the tokenizer their tiny models speak and the default evaluation text."""

import pytest
from helpers import pydoc_tokenizer

from compress.base.data import DataSpec, load_corpus


@pytest.fixture(scope="module")
def tokenizer():
    return pydoc_tokenizer()


@pytest.fixture(scope="module")
def texts():
    return load_corpus(DataSpec()).evaluation
