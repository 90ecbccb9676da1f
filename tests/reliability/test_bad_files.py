"""Bad files through the real CLI on a tiny model: a truncated safetensors file, a header that lies about a tensor's
shape or dtype, a config.json missing the keys its weights need, a missing tokenizer, checkpoints of other formats
(GPTQ-for-Llama, AutoGPTQ, AutoAWQ), recipe YAMLs with values of the wrong type and a corrupt calibration cache
entry. Each must end with one ``error:`` line naming the file and the fix, exit 2 (4 where the machine's own files
are damaged), no traceback and nothing published (docs/reliability.md, "Bad files")."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from cli_support import REPO, cli_env, run_statuses
from safetensors.torch import load_file, save_file

from compress.base.paths import recipes_dir

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "stages.0.group_size=32"]
QUIET = ["gate=none", "tracking.enabled=false"]
RUN = ["run", "recipe=rtn_int4", *SMALL, *QUIET]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def read_header(file: Path) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and the tensor bytes after it."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_header(file: Path, header: dict, payload: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def lying_header(source: Path, target: Path, tensor: str, **lie) -> Path:
    """A copy whose header says something else about ``tensor`` (``shape`` or ``dtype``) over the same bytes."""
    folder = copy_model(source, target)
    header, payload = read_header(folder / "model.safetensors")
    header[tensor].update(lie)
    write_header(folder / "model.safetensors", header, payload)
    return folder


def gptq_for_llama(source: Path, target: Path, config_extra: dict | None = None) -> Path:
    """The tiny model re-saved as GPTQ-for-Llama lays out int4 (``qweight``/``qzeros``/``scales``/``g_idx`` in place
    of every linear's ``weight``; its config.json has no quantization_config, AutoGPTQ's one says ``gptq``)."""
    folder = copy_model(source, target)
    tensors = load_file(folder / "model.safetensors")
    for name in [key for key in tensors if key.endswith(".weight") and key.split(".")[-2] in LINEARS]:
        out_features, in_features = tensors.pop(name).shape
        prefix, groups = name.removesuffix(".weight"), in_features // 32
        tensors[f"{prefix}.qweight"] = torch.zeros(in_features // 8, out_features, dtype=torch.int32)
        tensors[f"{prefix}.qzeros"] = torch.zeros(groups, out_features // 8, dtype=torch.int32)
        tensors[f"{prefix}.scales"] = torch.ones(groups, out_features, dtype=torch.float16)
        tensors[f"{prefix}.g_idx"] = torch.arange(in_features, dtype=torch.int32) // 32
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if config_extra:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | config_extra))
    return folder


def compressed_checkpoint(source: Path, target: Path) -> Path:
    """The tiny model quantized (RTN int4) and saved as a compressed-tensors checkpoint, as a run saves it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoint import save_checkpoint
    from compress.compression.in_memory import compress_model

    model = AutoModelForCausalLM.from_pretrained(source).eval()
    rtn = {"type": "rtn", "bits": 4, "group_size": 32, "symmetric": True}
    compress_model(model, [rtn], torch.zeros(1, 8, dtype=torch.long), batch_size=1)
    save_checkpoint(model, AutoTokenizer.from_pretrained(source), target)
    return target


def renamed_tensors(source: Path, target: Path, old: str, new: str) -> Path:
    """A copy whose tensors under ``old`` are saved under ``new`` (a conversion script's naming, not transformers')."""
    folder = copy_model(source, target)
    tensors = load_file(folder / "model.safetensors")
    save_file({name.replace(old, new): tensor for name, tensor in tensors.items()}, folder / "model.safetensors")
    return folder


def without_config_keys(source: Path, target: Path, *keys: str) -> Path:
    folder = copy_model(source, target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in keys}))
    return folder


def recipes_with(tmp_path: Path, name: str, text: str) -> Path:
    """A copy of the shipped recipes folder with one more recipe file (``COMPRESS_RECIPES`` points at it)."""
    folder = tmp_path / "recipes"
    if not folder.exists():
        shutil.copytree(recipes_dir(), folder)
    (folder / f"{name}.yaml").write_text(text)
    return folder


def run_cli(artifacts: Path, args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "compress", *args]
    return subprocess.Popen(command, cwd=REPO, env=cli_env(artifacts), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


# The CLI's own entry point (what `python -m compress` calls) run for each case in turn in one process, its stderr
# (file descriptor 2, so logging and tracebacks too) captured per case: one import of torch and transformers for
# every case instead of one each, on a 2-core machine where those imports are most of a failing command's time.
CASES_IN_ONE_PROCESS = """
import json, os, sys
from compress.__main__ import main
cases, results = json.loads(sys.argv[1]), {}
for name, (artifacts, args) in cases.items():
    os.environ["COMPRESS_ARTIFACTS"] = artifacts
    with open(artifacts + ".stderr", "w") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            code = main(args)
        except SystemExit as exit:
            code = exit.code
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    results[name] = code
print(json.dumps(results))
"""


def assert_one_clean_line(name: str, stderr: str, needles: tuple[str, ...], artifacts: Path) -> None:
    """One ``error:`` line holding every needle (the file, the fix), no traceback, nothing published."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr, (name, stderr[-3000:])
    assert len(errors) == 1, (name, stderr[-3000:])
    assert all(needle in errors[0] for needle in needles), (name, needles, errors[0])
    runs = artifacts / "runs"
    leftovers = [path.name for path in runs.iterdir() if path.name != ".progress"] if runs.exists() else []
    assert leftovers == [], (name, leftovers)
    assert not (runs / ".progress").exists() or not any((runs / ".progress").iterdir()), name
    assert not list((artifacts / "gates").glob("*/gate.json")), name
    assert run_statuses(artifacts / "mlflow.db") == [], name  # no MLflow run, so no verdict recorded there


def bad_model_cases(tiny: Path, tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """Each case: the CLI arguments and what its one line must say (the file it names and the fix)."""
    truncated = copy_model(tiny, tmp / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    layer = "model.layers.1.self_attn.q_proj.weight"
    shape_lie = lying_header(tiny, tmp / "shape-lie", layer, shape=[32, 128])
    dtype_lie = lying_header(tiny, tmp / "dtype-lie", layer, dtype="I32")
    size_lie = lying_header(tiny, tmp / "size-lie", layer, shape=[64, 128])
    no_hidden = without_config_keys(tiny, tmp / "no-hidden-size", "hidden_size")
    no_layers = without_config_keys(tiny, tmp / "no-layer-count", "num_hidden_layers")
    no_type = without_config_keys(tiny, tmp / "no-model-type", "model_type", "architectures")
    no_tokenizer = copy_model(tiny, tmp / "no-tokenizer")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / file).unlink()
    half_tokenizer = copy_model(tiny, tmp / "half-tokenizer")
    (half_tokenizer / "tokenizer.json").unlink()
    gptq = gptq_for_llama(tiny, tmp / "gptq-for-llama")
    autogptq = gptq_for_llama(
        tiny, tmp / "autogptq", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    )
    awq = gptq_for_llama(tiny, tmp / "autoawq")
    (awq / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4}))
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    autoawq = gptq_for_llama(tiny, tmp / "autoawq-config", {"quantization_config": awq_config})
    renamed = renamed_tensors(tiny, tmp / "renamed", "model.layers.1.", "transformer.h.1.")
    lacks = (str(renamed), "lacks 9 of the 21 tensors", "model.layers.1.self_attn.q_proj.weight", "random", "re-save")
    checkpoint = compressed_checkpoint(tiny, tmp / "checkpoint")
    scale = "model.layers.1.self_attn.q_proj.weight_scale"
    scale_lie = lying_header(checkpoint, tmp / "checkpoint-scale-lie", scale, shape=[32, 4])
    embed_lie = lying_header(checkpoint, tmp / "checkpoint-dtype-lie", "model.embed_tokens.weight", dtype="I32")
    gate = ["gate", f"baseline={tiny}", "gate.backend=transformers"]  # the verdict would land in artifacts/gates
    return {
        "truncated safetensors": ([*RUN, f"model={truncated}"], (str(weights), "truncated")),
        "truncated safetensors, gate": ([*gate, f"checkpoint={truncated}"], (str(weights), "truncated")),
        "header lies about a shape": ([*RUN, f"model={shape_lie}"], ("model.safetensors", layer, "(32, 128)")),
        "header lies about a shape, generate": (
            ["generate", f"checkpoint={shape_lie}", "prompt=hi", "max_tokens=2"],
            ("model.safetensors", layer, "(32, 128)"),
        ),
        "checkpoint header lies about a scale's shape, generate": (
            ["generate", f"checkpoint={scale_lie}", "prompt=hi", "max_tokens=2"],
            (str(scale_lie / "model.safetensors"), "config.json", "re-create it"),
        ),
        "checkpoint header lies about a dtype, generate": (
            ["generate", f"checkpoint={embed_lie}", "prompt=hi", "max_tokens=2"],
            ("model.embed_tokens.weight is stored as torch.int32", "re-create it"),
        ),
        "checkpoint header lies about a scale's shape, gate": (
            [*gate, f"checkpoint={scale_lie}"],
            (str(scale_lie / "model.safetensors"), "config.json", "re-create it"),
        ),
        "checkpoint header lies about a dtype, gate": (
            [*gate, f"checkpoint={embed_lie}"],
            ("model.embed_tokens.weight is stored as torch.int32", "re-create it"),
        ),
        "tensors saved under other names": ([*RUN, f"model={renamed}"], lacks),
        "tensors saved under other names, gate": ([*gate, f"checkpoint={renamed}"], lacks),
        "tensors saved under other names, gate baseline": (
            ["gate", f"checkpoint={tiny}", f"baseline={renamed}", "gate.backend=transformers"],
            lacks,
        ),
        "tensors saved under other names, generate": (
            ["generate", f"checkpoint={renamed}", "prompt=hi", "max_tokens=2"],
            lacks,
        ),
        "header lies about a dtype": ([*RUN, f"model={dtype_lie}"], ("model.safetensors", layer, "int32")),
        "header lies about a size": ([*RUN, f"model={size_lie}"], (str(size_lie / "model.safetensors"),)),
        "config.json without hidden_size": ([*RUN, f"model={no_hidden}"], ("config.json", "hidden_size")),
        "config.json without num_hidden_layers": ([*RUN, f"model={no_layers}"], ("config.json", "num_hidden_layers")),
        "config.json without model_type": ([*RUN, f"model={no_type}"], ("config.json", "model_type")),
        "no tokenizer": ([*RUN, f"model={no_tokenizer}"], (str(no_tokenizer), "tokenizer")),
        "tokenizer_config.json without tokenizer.json": ([*RUN, f"model={half_tokenizer}"], ("tokenizer.json",)),
        "GPTQ-for-Llama": ([*RUN, f"model={gptq}"], (str(gptq / "model.safetensors"), "qweight", "GPTQ")),
        "GPTQ-for-Llama, generate": (
            ["generate", f"checkpoint={gptq}", "prompt=hi", "max_tokens=2"],
            ("qweight", "GPTQ"),
        ),
        "AutoGPTQ": ([*RUN, f"model={autogptq}"], (str(autogptq / "config.json"), "gptq", "unquantized model")),
        "AutoAWQ through transformers": (
            [*RUN, f"model={autoawq}"],
            (str(autoawq / "config.json"), "awq", "full-precision", "unquantized model"),
        ),
        "AutoAWQ": ([*RUN, f"model={awq}"], (str(awq / "quant_config.json"), "AWQ")),
        "AutoAWQ, gate": ([*gate, f"checkpoint={awq}"], (str(awq / "quant_config.json"), "AWQ")),
        "config.json without hidden_size, generate": (
            ["generate", f"checkpoint={no_hidden}", "prompt=hi", "max_tokens=2"],
            ("config.json", "hidden_size"),
        ),
    }


def run_all(cases: dict, tmp_path: Path, recipes: Path | None = None) -> None:
    """Every case through the CLI's entry point in one process, then each judged: exit 2, one line, nothing written."""
    artifacts = {name: tmp_path / f"artifacts-{index}" for index, name in enumerate(cases)}
    payload = json.dumps({name: (str(artifacts[name]), args) for name, (args, _) in cases.items()})
    env = cli_env(tmp_path / "unused") | ({"COMPRESS_RECIPES": str(recipes)} if recipes else {})
    command = [sys.executable, "-c", CASES_IN_ONE_PROCESS, payload]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    failures = []
    for name, (_, needles) in cases.items():
        stderr = Path(f"{artifacts[name]}.stderr").read_text()
        try:
            assert codes[name] == 2, (name, codes[name], stderr[-3000:])
            assert_one_clean_line(name, stderr, needles, artifacts[name])
        except AssertionError as failure:
            failures.append(str(failure)[:1500])
    assert not failures, "\n\n".join(failures)


def test_bad_model_files_end_in_one_line_naming_the_file_and_write_nothing(tiny_model_dir, tmp_path):
    run_all(bad_model_cases(tiny_model_dir, tmp_path), tmp_path)


def test_a_recipe_file_with_a_value_of_the_wrong_type_is_named_in_one_line(tiny_model_dir, tmp_path):
    seed = "defaults:\n  - _base\n  - _self_\n\nseed: zero\nstages:\n  - type: rtn\n    bits: 4\n    group_size: 32\n"
    bits = "defaults:\n  - _base\n  - _self_\n\nstages:\n  - type: rtn\n    bits: four\n    group_size: 32\n"
    eval_len = "defaults:\n  - _base\n  - _self_\n\neval:\n  seq_len: [64]\nstages:\n  - type: rtn\n    bits: 4\n"
    recipes = recipes_with(tmp_path, "bad_seed", seed)
    recipes_with(tmp_path, "bad_bits", bits)
    recipes_with(tmp_path, "bad_eval", eval_len)
    model = [f"model={tiny_model_dir}", *QUIET]
    cases = {
        "seed: zero": (["run", "recipe=bad_seed", *model], ("bad_seed.yaml", "seed", "an integer")),
        "bits: four": (["run", "recipe=bad_bits", *model], ("bad_bits.yaml", "stages.0.bits", "an integer")),
        "eval.seq_len: [64]": (["run", "recipe=bad_eval", *model], ("bad_eval.yaml", "eval.seq_len", "an integer")),
    }
    run_all(cases, tmp_path, recipes)


def test_a_corrupt_calibration_cache_entry_is_named_in_one_line(tiny_model_dir, tmp_path):
    """The first run samples its calibration windows into artifacts/calibration; damaged there (cut short, or
    replaced by a tensor of another shape), the next run names the entry and says to delete it (exit 4: the machine's
    own file), instead of a traceback or calibrating on what it holds."""
    artifacts = tmp_path / "artifacts"
    args = ["run", "recipe=gptq_int4", f"model={tiny_model_dir}", "data=sampled", *SMALL, *QUIET, "resume=false"]
    first = run_cli(artifacts, args)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    shutil.rmtree(artifacts / "runs")
    (entry,) = (artifacts / "calibration").glob("*.pt")
    intact = entry.read_bytes()
    for damage in ("cut short", "another shape"):
        if damage == "cut short":
            entry.write_bytes(intact[:100])
        else:
            torch.save(torch.zeros(3, 5, dtype=torch.long), entry)
        again = run_cli(artifacts, args)
        _, stderr = again.communicate(timeout=300)
        assert again.returncode == 4, (damage, stderr[-3000:])
        assert_one_clean_line(damage, stderr, (str(entry), "delete it"), artifacts)


def test_every_tiny_family_passes_the_tensor_check_and_one_without_a_layer_is_named(tmp_path):
    """The missing-tensor check compares with what transformers loads: a tied head left out, legacy names it renames
    and per-expert tensors it fuses on load are not missing. Every family the tests build passes as saved, and
    refuses once a layer's tensors are saved under other names; an untied head left out is named."""
    from helpers import (
        FAMILIES,
        MOE_FAMILIES,
        build_tiny_deepseek_v3,
        build_tiny_llama,
        build_tiny_model,
        build_tiny_moe,
    )

    from compress.base.errors import CompressError
    from compress.checkpoint.validation import check_model_files

    builders = {family: partial(build_tiny_model, family) for family in FAMILIES}
    builders |= {family: partial(build_tiny_moe, family) for family in MOE_FAMILIES}
    builders |= {
        "deepseek_v3": build_tiny_deepseek_v3,
        "llama, untied head": partial(build_tiny_llama, tie_word_embeddings=False),
    }
    for family, build in builders.items():
        folder = tmp_path / family
        build().save_pretrained(folder)
        check_model_files(folder)
        renamed = renamed_tensors(folder, tmp_path / f"{family} renamed", ".layers.1.", ".blocks.1.")
        with pytest.raises(CompressError, match=r"lacks \d+ of the \d+ tensors .* \(model\.layers\.1\.") as refused:
            check_model_files(renamed)
        assert str(renamed) in str(refused.value), family
    untied = tmp_path / "llama, untied head"
    tensors = load_file(untied / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, untied / "model.safetensors")
    with pytest.raises(CompressError, match=r"lacks 1 of the 21 tensors .* \(lm_head\.weight\)"):
        check_model_files(untied)
