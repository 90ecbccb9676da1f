"""Source-dtype loading, lazy per-layer reading and per-layer fp32 calibration on real tiny bf16 checkpoints."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from compress.__main__ import main
from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.grids.int_grid import WeightScheme, quantize
from compress.model.layer_walk import decoder_layers
from compress.model.lazy_weights import materialize_all
from compress.model.sources import load
from compress.stages import LayerContext, Stage, build_chain

CPU = torch.device("cpu")


def _save_bf16(folder: Path, **save_args) -> Path:
    tokenizer = build_tiny_tokenizer()
    build_tiny_llama(vocab_size=len(tokenizer)).to(torch.bfloat16).save_pretrained(folder, **save_args)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return _save_bf16(tmp_path_factory.mktemp("tiny-bf16"))


def _on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in module.state_dict().values())


def _logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_lazy_load_reads_layers_only_when_asked_and_keeps_ties(bf16_dir):
    model, _ = load(bf16_dir)
    assert model.dtype == torch.bfloat16  # dtype=auto: the checkpoint's own
    assert all(_on_meta(layer) for layer in decoder_layers(model))
    assert not model.model.embed_tokens.weight.is_meta and not model.model.norm.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight
    materialize_all(model)
    assert not _on_meta(model) and model.lm_head.weight is model.model.embed_tokens.weight
    eager = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    assert torch.equal(_logits(model), _logits(eager))


def test_sharded_checkpoint_loads_lazily(tmp_path):
    folder = _save_bf16(tmp_path / "sharded", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    model, _ = load(folder)
    assert len(set(model.lazy_weights.weight_map.values())) > 1
    materialize_all(model)
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)))


def test_dtype_override_and_eager_callers(bf16_dir):
    widened, _ = load(bf16_dir, dtype="float32")
    materialize_all(widened)
    assert {p.dtype for p in widened.parameters()} == {torch.float32}
    whole, _ = load(bf16_dir, lazy=False)  # the gate, the engine: the whole model
    assert not _on_meta(whole) and whole.dtype == torch.bfloat16
    with pytest.raises(CompressError, match="model.dtype='float64' is not supported"):
        load(bf16_dir, dtype="float64")


def test_checkpoint_names_that_differ_fall_back_to_the_eager_load(tmp_path, bf16_dir):
    folder = _save_bf16(tmp_path / "renamed")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.unused_extra"] = torch.zeros(3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model, _ = load(folder)
    assert getattr(model, "lazy_weights", None) is None and not _on_meta(model)


@dataclass
class _ProbeConfig:
    pass


class _Probe(Stage):
    """Records what a stage sees of each layer: dtypes, and how many layers are still unread."""

    name = "probe"
    Config = _ProbeConfig

    def __init__(self, model):
        super().__init__(_ProbeConfig())
        self.model, self.seen = model, []

    def process_layer(self, ctx: LayerContext) -> None:
        unread = sum(_on_meta(layer) for layer in decoder_layers(self.model))
        self.seen.append((ctx.layer.mlp.up_proj.weight.dtype, ctx.inputs.hidden[0].dtype, ctx.dtype, unread))


def test_walk_reads_one_layer_at_a_time_calibrates_in_fp32_and_stores_in_bf16(bf16_dir):
    model, _ = load(bf16_dir)
    original = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    probe = _Probe(model)
    [rtn] = build_chain([{"type": "rtn", "bits": 4, "group_size": 32}])
    samples = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    compress_model(model, [probe, rtn], samples, CPU, batch_size=2)

    fp32, bf16 = torch.float32, torch.bfloat16
    assert probe.seen == [(fp32, fp32, bf16, 1), (fp32, fp32, bf16, 0)]  # layer 1 unread while layer 0 is processed
    assert not _on_meta(model)
    layer = decoder_layers(model)[0]
    assert layer.input_layernorm.weight.dtype == bf16  # dense tensors went back to the source dtype
    q_proj = layer.self_attn.q_proj
    assert isinstance(q_proj, QuantizedLinear) and q_proj.weight_scale.dtype == bf16
    reference = original.model.layers[0].self_attn.q_proj.weight
    codes, scale, zero = quantize(reference.float(), rtn.config.scheme, scale_dtype=bf16)  # scale rounded first
    expected = QuantizedLinear.from_codes(codes, scale, zero, 4, 32)
    assert torch.equal(q_proj.weight_scale, scale) and torch.equal(q_proj.weight_packed, expected.weight_packed)


def test_a_quantized_linear_keeps_a_dense_weight_only_when_asked_and_drops_it_when_moved():
    """Outside the engine the CPU forward keeps no dense copy (calibration, evaluation: a copy of every layer);
    the engine's opt-in copy goes when the module moves."""
    module = QuantizedLinear.from_codes(*quantize(torch.randn(8, 64), WeightScheme(4, 32, True)), 4, 32)
    module(torch.randn(2, 64))
    assert "_dense" not in module.__dict__
    module.keep_dense_on_cpu = True
    module(torch.randn(2, 64))
    assert "_dense" in module.__dict__
    module.to("cpu")
    assert "_dense" not in module.__dict__


SMALL = [
    "data.num_samples=4",
    "data.seq_len=64",
    "eval.seq_len=64",
    "eval.max_windows=2",
    "gate=none",
    "tracking.enabled=false",
    "stages.0.group_size=32",
]


def _run(model_dir: Path, runs: Path, *overrides: str) -> dict:
    assert main(["run", "recipe=rtn_int4", f"model={model_dir}", *SMALL, f"output.dir={runs}", *overrides]) == 0
    [report] = runs.glob("*/report.json")
    return json.loads(report.read_text())


def test_bf16_source_run_is_comparable_with_the_old_fp32_run(bf16_dir, artifacts, tmp_path):
    """The baseline perplexity of the lazy bf16 run equals the eager fp32 run's (CPU evaluates in fp32); the
    checkpoint keeps the source dtype, its int4 scales included."""
    lazy = _run(bf16_dir, tmp_path / "lazy")
    eager = _run(bf16_dir, tmp_path / "eager", "model.dtype=float32", "model.lazy=false")
    assert lazy["perplexity"]["baseline"]["perplexity"] == pytest.approx(
        eager["perplexity"]["baseline"]["perplexity"], rel=1e-5
    )
    assert lazy["perplexity"]["candidate"]["perplexity"] == pytest.approx(
        eager["perplexity"]["candidate"]["perplexity"], rel=2e-2
    )
    checkpoint = Path(lazy["checkpoint"]["path"])
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype == torch.bfloat16
        assert handle.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.bfloat16
    assert lazy["checkpoint"]["size_mb"] < eager["checkpoint"]["size_mb"]


def test_gpu_compress_benchmark_runs_on_cpu_with_a_tiny_shape(tmp_path):
    from benchmarks.gpu_compress import main as gpu_compress

    assert gpu_compress(["--tiny", "--device", "cpu", "--samples", "2", "--seq-len", "32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu-compress-cpu.json").read_text())
    assert result["device_name"] == "cpu" and set(result["algorithms"]) == {"gptq", "awq"}
    assert all(row["summary"]["quantized_linears"] == 14 for row in result["algorithms"].values())


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status on this platform")


def test_the_layer_walk_gives_each_finished_layers_memory_back(tmp_path):
    """Host memory grows by what the compressed layers keep, not by the dense layers read and widened on the way:
    without handing freed heap pages back, glibc kept ~1.4x every layer's bf16 size (a 3.8B model peaked at 1.06x
    its weight file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = load(str(tmp_path))
    dense_layers_mb = sum(p.numel() * 2 for p in model.model.layers.parameters()) / 2**20
    before = _rss_mb()
    compress_model(model, [{"type": "rtn", "bits": 4, "group_size": 64}], torch.zeros(1, 8, dtype=torch.long))
    assert _rss_mb() - before < 0.5 * dense_layers_mb


def test_a_lazy_model_is_freed_when_its_last_reference_goes_without_a_gc_pass(bf16_dir):
    """Each layer's read-on-forward hook used to hold the model itself: a cycle that kept a dropped model (the gate's
    baseline, 538 MB on the default model) in memory until the garbage collector happened to run."""
    import gc
    import weakref

    model, _ = load(bf16_dir)
    materialize_all(model)
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()


def test_a_lazy_model_keeps_the_folders_generation_config(tmp_path):
    """Built from config.json alone, the lazy model had a generation config derived from it: extra stop tokens in
    generation_config.json were lost, in the engine's stop set and in the checkpoint the run writes."""
    folder = _save_bf16(tmp_path / "model")
    settings = json.loads((folder / "generation_config.json").read_text())
    settings["eos_token_id"] = [2, 7]
    (folder / "generation_config.json").write_text(json.dumps(settings))
    model, _ = load(folder)
    assert model.lazy_weights is not None and model.generation_config.eos_token_id == [2, 7]
