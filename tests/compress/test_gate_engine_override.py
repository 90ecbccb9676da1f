"""``gate.engine.<option>=<value>`` sets an engine option whether or not the gate preset already sets it: gate=quick
sizes its KV pool for a CPU (64 MB), and a GPU run of an 8B model must be able to enlarge it."""

from __future__ import annotations

import pytest

from compress.app.recipe import check_overrides, compose_job, resolve_shortcuts
from compress.app.run_config import register_schema


@pytest.mark.parametrize("gate", ["quick", "default"])  # quick sets kv_cache_memory_gb, default sets no option
def test_an_engine_option_is_set_whether_or_not_the_preset_has_it(gate, tiny_model_dir):
    register_schema()
    overrides = [f"model={tiny_model_dir}", f"gate={gate}", "gate.engine.kv_cache_memory_gb=2"]
    config = compose_job("rtn_int4", check_overrides("rtn_int4", resolve_shortcuts(overrides)))
    assert config.raw["gate"]["engine"]["kv_cache_memory_gb"] == 2
