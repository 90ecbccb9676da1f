"""One reference of every configuration key (``compress config``, ``docs/config.md``), read from the typed classes,
and the gate's engine options typed like every other section, so the schema refuses a typo while composing."""

from __future__ import annotations

import pytest

from compress.config import RunConfig
from compress.errors import CompressError
from compress.evals.gate import resolve_policy
from compress.typed import typed


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gate": {"engine": {"max_num_seq": 4}}},
            "gate.engine: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)",
        ),
        ({"gate": {"engine": {"block_size": "sixteen"}}}, "gate.engine.block_size='sixteen' has the wrong type"),
        ({"gate": {"engine": {"block_size": 24}}}, "gate.engine: block_size=24 must be a power of two"),
    ],
)
def test_the_schema_refuses_a_bad_gate_engine_key_while_composing(values, message):
    """The run schema itself (what Hydra composes against), not a check after it."""
    with pytest.raises(CompressError) as error:
        typed(RunConfig, {"recipe": "rtn_int4", **values})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_engine_kv_cache_dtype_is_the_gates_own_key():
    """Two keys for one setting: the engine's would reach the engine beside the gate's and crash there."""
    with pytest.raises(CompressError, match="set gate.kv_cache_dtype=int8"):
        resolve_policy({"engine": {"kv_cache_dtype": "int8"}})
