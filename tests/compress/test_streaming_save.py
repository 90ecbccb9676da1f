"""Checkpoints written during the layer walk: each finished layer goes to the shards and leaves memory."""

import json
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_moe
from safetensors.torch import load_file

from compress.checkpoint import CheckpointWriter, load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.compression.saving import write_checkpoint
from compress.stages import build_chain

GPTQ_KV = [{"type": "gptq", "bits": 4, "group_size": 32}, {"type": "kv_cache", "dtype": "int8"}]


def _samples() -> torch.Tensor:
    return torch.randint(0, 320, (4, 16), generator=torch.Generator().manual_seed(0))


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(shard))
    return tensors


def _on_meta(module: torch.nn.Module) -> bool:
    return all(t.is_meta for t in module.state_dict().values())


BUILDERS = {"llama": lambda: build_tiny_llama(seed=5), "qwen3_moe": lambda: build_tiny_moe("qwen3_moe", seed=5)}


@pytest.mark.parametrize("family", BUILDERS)
def test_walk_writes_each_finished_layer_and_drops_it_with_the_same_checkpoint_as_a_save_at_the_end(family, tmp_path):
    streamed, whole = BUILDERS[family](), BUILDERS[family]()
    stages = build_chain(GPTQ_KV)
    layers_on_meta_when_written = []
    with CheckpointWriter(tmp_path / "streamed", torch.bfloat16) as writer:
        sink = writer.layer_sink(streamed)

        def spy(name: str) -> None:
            layers_on_meta_when_written.append([_on_meta(layer) for layer in streamed.model.layers])
            sink(name)

        summaries = compress_model(streamed, stages, _samples(), batch_size=2, layer_done=spy)
        assert all(_on_meta(layer) for layer in streamed.model.layers)  # the whole compressed model never in RAM
        streamed_summary = write_checkpoint(writer, streamed, None, stages, summaries, "gptq_kv", GPTQ_KV)
    assert layers_on_meta_when_written == [[True] * i + [False] * (2 - i) for i in range(2)]
    whole_stages = build_chain(GPTQ_KV)
    compress_model(whole, whole_stages, _samples(), batch_size=2)
    whole_summary = save_checkpoint(
        whole, None, tmp_path / "whole", dtype=torch.bfloat16, kv_cache_scheme=whole_stages[1].kv_cache_scheme
    )
    ours, theirs = _stored(tmp_path / "streamed"), _stored(tmp_path / "whole")
    assert set(ours) == set(theirs) and all(torch.equal(ours[key], theirs[key]) for key in ours)
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert config == json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    same = {"path": "", "size_mb": 0}  # the shard headers list the tensors in another order
    assert {**streamed_summary.to_dict(), **same} == {**whole_summary.to_dict(), **same}
    assert json.loads((tmp_path / "streamed" / "size.json").read_text())["quantized_linears"] > 0
    load_checkpoint(tmp_path / "streamed")  # and it loads


@pytest.mark.parametrize(
    "chain",
    [
        [{"type": "magnitude_prune", "sparsity": "2:4"}, {"type": "rtn", "bits": 4, "group_size": 32}],
        [{"type": "rtn", "bits": 4, "group_size": 32}, {"type": "distill", "steps": 1, "seq_len": 8, "held_out": 1}],
    ],
    ids=["pruner-checks-masks-at-the-end", "whole-model-stage-last"],
)
def test_chains_that_read_layers_after_the_walk_keep_the_model_whole(chain):
    model = build_tiny_llama(seed=5)
    heard: list[str] = []
    compress_model(model, chain, _samples(), batch_size=2, layer_done=heard.append)
    assert heard == [] and not any(_on_meta(layer) for layer in model.model.layers)


def test_an_interrupted_walk_leaves_no_checkpoint_and_no_staging(tmp_path):
    model = build_tiny_llama(seed=5)
    with pytest.raises(KeyboardInterrupt), CheckpointWriter(tmp_path / "ckpt") as writer:
        sink = writer.layer_sink(model)

        def interrupted(name: str) -> None:
            sink(name)
            raise KeyboardInterrupt

        compress_model(model, [{"type": "rtn", "bits": 4, "group_size": 32}], _samples(), layer_done=interrupted)
    assert list(tmp_path.iterdir()) == []
