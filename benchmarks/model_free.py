"""Model-free quantization (``compress.compression.model_free``) vs the layer walk, and vs reading the input files once.

    COMPRESS_ARTIFACTS=/path/to/artifacts python benchmarks/model_free.py          # rtn_int4 and fp8_dynamic
    python benchmarks/model_free.py --recipes rtn_int4 --results /tmp/mf           # elsewhere, one recipe
    python benchmarks/model_free.py --random-shape 4b --recipes rtn_int4 --repeats 1  # a random 3.8B Llama

``--random-shape`` runs on a random bf16 Llama of ``benchmarks/peak_rss.py``'s ``SHAPES`` (``save_random_llama``,
written by a child process into the work folder, under ``--workdir`` or the system temp folder, and deleted
afterwards) instead of the default model; its results go to ``model-free-<shape>.{json,md}``, which state the shape,
parameter count, file size, largest tensor, and for each path whether its peak RSS over ``read`` is at most twice the
largest tensor. ``--skip`` leaves rows out (e.g. ``layer_walk`` where it would take too long).

On the default model's converted folder (``local_model_folder(ModelSpec())``; nothing is converted or downloaded:
the script stops if the folder is missing), each row is one fresh subprocess, timed and measured by GNU time
(``benchmarks/peer_comparison.measured_run``). ``read`` reads every byte of the safetensors files once through one
8 MB buffer: the floor any path pays; it imports what the other rows import, so its peak RSS is their baseline.
``model_free`` is ``quantize_model_free``. ``layer_walk`` is what ``compress run`` does before its evaluations: lazy
load, ``compress_model`` streaming into ``checkpoint_writer``, ``write_checkpoint`` (no calibration text: the
chains are data-free). ``work s`` is the timed part inside the process, ``process s`` adds interpreter start and
imports. A warm-up read first puts the files in the page cache for every row. The first round's two checkpoints
are compared tensor by tensor. Results: ``benchmarks/results/model-free.{json,md}``.

``llmcompressor`` is llm-compressor's own model-free path (``llmcompressor.model_free_ptq``) on the same files, from a
side directory of packages on the child's ``PYTHONPATH`` (after this tree, before the venv) (``--peer-site``, default
``<artifacts>/peer-site``), created with

    python -m pip install --target artifacts/peer-site --no-deps llmcompressor==0.14.0.1 compressed-tensors loguru

(this project's venv has its other dependencies); if the directory is missing the row is skipped with a note. Its
scheme is ours: for rtn_int4 a ``QuantizationScheme`` (targets ``Linear``, int4 symmetric, group 64: the ``W4A16``
preset is group 128), for fp8_dynamic the ``FP8_DYNAMIC`` preset; ``device="cpu"``, ``max_workers=1`` (the machine's
cores are shared). ``ignore`` is ``lm_head`` and ``re:.*embed_tokens$``: its model-free path picks tensors by name, not
module class (target ``Linear`` matches every ``.weight`` but norms'), so with ``lm_head`` alone it quantizes the
embedding, tied (the default model's, to int4) or not (the random models'), which ours, targeting linears only, keeps
dense. It reads a view of the model folder (links to the files, config.json
without ``"quantization_config": null``, which llm-compressor 0.14.0.1 fails on after quantizing). Its first-round
checkpoint is compared with model_free's: tensor names, dtypes, values.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.model_free_report import PEER, markdown  # noqa: E402
from benchmarks.peak_rss import SHAPES  # noqa: E402
from benchmarks.peer_comparison import checkpoint_size_mb, measured_run  # noqa: E402
from compress.base.paths import artifacts_dir  # noqa: E402
from compress.model.sources import ModelSpec, local_model_folder  # noqa: E402

MODES = ("read", "model_free", "layer_walk", "llmcompressor")
PEER_PIP = (
    "python -m pip install --target artifacts/peer-site --no-deps llmcompressor==0.14.0.1 compressed-tensors loguru"
)
PEER_IGNORE = ["lm_head", "re:.*embed_tokens$"]


def stages_of(recipe: str) -> list[dict]:
    return yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["stages"]


def peer_scheme(recipe: str):
    """llm-compressor's scheme for ``recipe``: ours, in its terms."""
    if recipe == "fp8_dynamic":
        return "FP8_DYNAMIC"
    if recipe == "rtn_int4":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    raise SystemExit(f"no llm-compressor scheme for {recipe}")


def child(mode: str, folder: Path, recipe: str, target: Path) -> None:
    """One row's work in this process; prints its own timed seconds as the last line."""
    if mode == PEER:
        from llmcompressor import model_free_ptq

        scheme = peer_scheme(recipe)
        start = time.perf_counter()
        model_free_ptq(folder, target, scheme=scheme, ignore=PEER_IGNORE, max_workers=1, device="cpu")
        print(f"work_s {time.perf_counter() - start:.3f}")
        return
    from compress.compression.in_memory import compress_model
    from compress.compression.model_free import quantize_model_free
    from compress.compression.saving import checkpoint_writer, write_checkpoint
    from compress.model.sources import load
    from compress.stages import build_chain

    chain = stages_of(recipe)
    start = time.perf_counter()
    if mode == "read":  # every byte through a reused buffer (safe_open's tensors map pages they may never touch)
        buffer = bytearray(8 * 2**20)
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
    elif mode == "model_free":
        quantize_model_free(folder, build_chain(chain), target, recipe=recipe, stage_args=chain)
    else:
        model, tokenizer = load(ModelSpec(str(folder)))
        stages = build_chain(chain)
        with checkpoint_writer(target, None) as writer:
            samples = torch.zeros(1, 8, dtype=torch.long)  # read by no data-free stage
            summaries = compress_model(model, stages, samples, "cpu", 8, writer.layer_sink(model))
            write_checkpoint(writer, model, tokenizer, stages, summaries, recipe, chain)
    print(f"work_s {time.perf_counter() - start:.3f}")


def tensor_stats(folder: Path) -> dict:
    """From the headers: the parameter count and the largest input tensor (about what model-free holds above its
    imports: it and its stored form, one at a time)."""
    from safetensors import safe_open

    widths = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
    params, largest, name = 0, 0, ""
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                view = handle.get_slice(key)
                count = math.prod(view.get_shape())
                params += count
                if count * widths.get(view.get_dtype(), 1) > largest:
                    largest, name = count * widths.get(view.get_dtype(), 1), key
    return {"params": params, "largest_tensor_mb": largest / 1e6, "largest_tensor": name}


class Tensors:
    """A checkpoint's tensors by name, read one at a time (a 4B model's two checkpoints need not fit at once)."""

    def __init__(self, folder: Path, stack: ExitStack):
        from safetensors import safe_open

        self.handles = {}
        for shard in sorted(folder.glob("*.safetensors")):
            handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            self.handles.update(dict.fromkeys(handle.keys(), handle))

    def names(self) -> set[str]:
        return set(self.handles)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handles[name].get_tensor(name)


def identical(first: Path, second: Path) -> bool:
    with ExitStack() as stack:
        ours, theirs = Tensors(first, stack), Tensors(second, stack)
        return ours.names() == theirs.names() and all(torch.equal(ours[key], theirs[key]) for key in ours.names())


def compare_peer(ours: Path, theirs: Path) -> dict:
    """llm-compressor's checkpoint against ours: names, then dtypes and shapes, then values (bit for bit)."""

    def bits(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).view(torch.uint8)

    with ExitStack() as stack:
        a, b = Tensors(ours, stack), Tensors(theirs, stack)
        common = sorted(a.names() & b.names())
        dtype_or_shape, values, differing_bytes, compared_bytes = [], [], 0, 0
        for key in common:
            first, second = a[key], b[key]
            if first.dtype != second.dtype or first.shape != second.shape:
                dtype_or_shape.append(key)
                continue
            first, second = bits(first), bits(second)
            compared_bytes += first.numel()
            if not torch.equal(first, second):
                values.append(key)
                differing_bytes += int((first != second).sum())
        return {
            "tensors_ours": len(a.names()),
            "tensors_theirs": len(b.names()),
            "only_ours": sorted(a.names() - b.names()),
            "only_theirs": sorted(b.names() - a.names()),
            "dtype_or_shape_differ": dtype_or_shape,
            "values_differ": values,
            "differing_bytes": differing_bytes,
            "compared_bytes": compared_bytes,
        }


def peer_view(folder: Path, work: Path) -> Path:
    """The model folder as llm-compressor 0.14.0.1 can read it: links to its files, and config.json without a null
    ``quantization_config`` (it pops from it after quantizing)."""
    view = work / "peer-input"
    view.mkdir()
    for file in folder.iterdir():
        if file.name != "config.json":
            (view / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    if config.get("quantization_config", {}) is None:
        del config["quantization_config"]
    (view / "config.json").write_text(json.dumps(config, indent=2))
    return view


def measure(mode: str, folder: Path, recipe: str, work: Path, round_: int = 0, peer_site: Path | None = None) -> dict:
    target = work / f"{recipe}-{mode}-{round_}"
    log = work / f"{recipe}-{mode}-{round_}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--recipe", recipe]
    if mode == PEER:  # measured_run sets PYTHONPATH to the tree; env puts the peer site after it (same process)
        command = ["env", f"PYTHONPATH={ROOT}{os.pathsep}{peer_site}", *command]
    result = measured_run([*command, "--model", str(folder), "--target", str(target)], log, timeout=3600)
    if not result["ok"]:
        raise SystemExit(f"{recipe} {mode}: {result['error']}")
    work_lines = [line for line in log.read_text().splitlines() if line.startswith("work_s ")]
    work_s = float(work_lines[-1].split()[1])
    row = {"work_s": work_s, "process_s": result["wall_s"], "peak_rss_mb": result["peak_rss_mb"]}
    if mode != "read":
        row["checkpoint_mb"] = checkpoint_size_mb(target)
        if round_:  # the first round's checkpoints are compared; the others only take disk
            shutil.rmtree(target)
    return row


def create_random(shape_name: str, folder: Path, work: Path) -> dict:
    """``save_random_llama`` in a child process (its memory is gone before the rows run), timed and measured."""
    command = [sys.executable, str(Path(__file__).resolve()), "--create-random", shape_name, "--target", str(folder)]
    result = measured_run(command, work / "create-random.log", timeout=3600)
    if not result["ok"]:
        raise SystemExit(f"creating the random {shape_name} model failed: {result['error']}")
    return {
        "name": shape_name,
        "shape": SHAPES[shape_name],
        "create_s": result["wall_s"],
        "create_peak_rss_mb": result["peak_rss_mb"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["rtn_int4", "fp8_dynamic"])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the rows per recipe")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--peer-site",
        type=Path,
        help="packages for the llmcompressor row, added to its PYTHONPATH (default: <artifacts>/peer-site; "
        "the row is skipped when missing)",
    )
    parser.add_argument(
        "--random-shape",
        choices=list(SHAPES),
        help="run on a random bf16 Llama of this benchmarks/peak_rss.py shape instead of the default model "
        "(4b: 3.8B parameters, 7.3 GB); results model-free-<shape>.{json,md}",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="where the temporary work folder (random model, checkpoints) goes (default: the temp folder)",
    )
    parser.add_argument("--skip", nargs="+", choices=MODES[1:], default=[], help="rows to leave out")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the stored .json; no run")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--create-random", choices=list(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.recipe, args.target)
        return 0
    if args.create_random:
        from benchmarks.peak_rss import save_random_llama

        print(f"params {save_random_llama(args.target, SHAPES[args.create_random], torch.bfloat16)}")
        return 0
    name = f"model-free-{args.random_shape}" if args.random_shape else "model-free"
    if args.render_only:
        (args.results / f"{name}.md").write_text(markdown(json.loads((args.results / f"{name}.json").read_text())))
        return 0
    folder = None if args.random_shape else local_model_folder(ModelSpec())
    if folder is None and not args.random_shape:
        raise SystemExit("the default model is not converted here; point COMPRESS_ARTIFACTS at a folder holding it")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children's; the machine is shared
    peer_site = args.peer_site or artifacts_dir() / "peer-site"
    versions = sorted(path.name.removesuffix(".dist-info") for path in peer_site.glob("*.dist-info"))
    skipped = [f"{mode} (--skip)" for mode in args.skip]
    if any(version.startswith("llmcompressor-") for version in versions):
        peer_note = (
            f"model_free_ptq from {peer_site} ({', '.join(versions)}), device cpu, max_workers=1 (shared cores)."
        )
    else:
        args.skip.append(PEER)
        peer_note = f"skipped: no llmcompressor in {peer_site} (create it with `{PEER_PIP}`)."
    modes = tuple(mode for mode in MODES if mode not in args.skip)
    artifacts = [f"COMPRESS_ARTIFACTS={os.environ['COMPRESS_ARTIFACTS']}"] if "COMPRESS_ARTIFACTS" in os.environ else []
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="model-free-", dir=args.workdir) as tmp:
        work = Path(tmp)
        random = None
        if args.random_shape:
            folder = work / "model"
            random = create_random(args.random_shape, folder, work)
        config = json.loads((folder / "config.json").read_text())
        report = {
            "model": str(folder),
            **({"random_shape": random} if random else {}),
            "dtype": config.get("dtype") or config.get("torch_dtype"),
            "weights_mb": sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6,
            "files": len(list(folder.glob("*.safetensors"))),
            **tensor_stats(folder),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
            "threads": f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} in every row.",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join([*artifacts, "python", "benchmarks/model_free.py", *(argv or sys.argv[1:])]),
            "llm_compressor": peer_note,
            "modes": list(modes),
            "skipped": ", ".join(skipped),
            "repeats": args.repeats,
            "recipes": {},
        }
        measure("read", folder, args.recipes[0], work)  # warm-up: the files into the page cache
        view = peer_view(folder, work) if PEER in modes else None
        for recipe in args.recipes:
            rows = {mode: [] for mode in modes}
            for round_ in range(args.repeats):
                for mode in modes:
                    source = view if mode == PEER else folder
                    rows[mode].append(measure(mode, source, recipe, work, round_, peer_site))
                    print(f"{recipe} {mode} round {round_}: {rows[mode][-1]}", flush=True)
            if "layer_walk" in modes:
                rows["identical"] = identical(work / f"{recipe}-model_free-0", work / f"{recipe}-layer_walk-0")
            if PEER in modes:
                rows["vs_llmcompressor"] = compare_peer(work / f"{recipe}-model_free-0", work / f"{recipe}-{PEER}-0")
            report["recipes"][recipe] = rows
    print(markdown(report))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{name}.json").write_text(json.dumps(report, indent=2))
    (args.results / f"{name}.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
