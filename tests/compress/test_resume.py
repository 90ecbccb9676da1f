"""Layer-level resume: a run killed (SIGKILL) mid-walk and run again continues at the next layer and ends with the
same checkpoint tensors as a run that was never stopped; a changed recipe starts over and says why."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from cli_support import REPO, cli_env
from safetensors.torch import load_file

from compress.__main__ import main
from compress.app.recipe import compose
from compress.base.locks import lock_beside
from compress.compression.in_memory import compress_model
from compress.model.resume import WalkProgress
from compress.stages import build_chain
from tests.compress.test_distributed import torchrun
from tests.reliability.faults import injected

LAYERS = 4
KILL_AFTER = 1  # the process dies once layer 1's progress is on disk: the re-run resumes at layer 2
RESUMED = "the re-run resumes at the next layer and ends with the tensors of a run never stopped"
QUICK = [
    "data.num_samples=4",
    "data.seq_len=64",
    "calibration_batch_size=2",
    "eval.perplexity=false",
    "eval.data=null",
    "gate=none",
    "tracking.enabled=false",
]
RECIPES = {
    "gptq": ["recipe=gptq_int4", "stages.0.group_size=32"],
    "awq": ["recipe=awq_int4", "stages.0.group_size=32"],
}
# SIGKILL from inside the walk, right after layer KILL_AFTER's progress is kept: what an OOM kill or a pre-emption
# does at that point, at a point the test can name.
KILLED_RUN = """
import os, signal, sys
from compress.model import resume
keep = resume.WalkProgress.save
def keep_then_die(self, index, *args):
    keep(self, index, *args)
    if index == {kill_after}:
        os.kill(os.getpid(), signal.SIGKILL)
resume.WalkProgress.save = keep_then_die
from compress.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory) -> Path:
    from helpers import build_tiny_llama, build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("four-layers")
    tokenizer = build_tiny_tokenizer()
    build_tiny_llama(vocab_size=len(tokenizer), num_hidden_layers=LAYERS).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from helpers import build_tiny_moe, build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("moe")
    tokenizer = build_tiny_tokenizer()
    build_tiny_moe("qwen3_moe", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def killed_run(args: list[str], artifacts: Path) -> subprocess.CompletedProcess:
    code = KILLED_RUN.format(kill_after=KILL_AFTER)
    command = [sys.executable, "-c", code, "run", *args]
    return subprocess.run(command, cwd=REPO, env=cli_env(artifacts), capture_output=True, text=True, timeout=300)


def checkpoint_of(runs: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The one published run's checkpoint tensors and what each stage reported (wall times left out)."""
    (run,) = [folder for folder in runs.iterdir() if not folder.name.startswith(".")]
    tensors = {}
    for shard in sorted((run / "checkpoint").glob("*.safetensors")):
        tensors.update(load_file(shard))
    stages = json.loads((run / "checkpoint" / "stages.json").read_text())
    for summary in stages.values():
        for wall_time in [key for key in summary if key.endswith("seconds")]:  # seconds, AWQ's rounding_seconds
            summary.pop(wall_time)
    return tensors, stages


def assert_same_checkpoint(resumed: Path, uninterrupted: Path) -> None:
    tensors, stages = checkpoint_of(resumed)
    expected_tensors, expected_stages = checkpoint_of(uninterrupted)
    assert tensors.keys() == expected_tensors.keys()
    for key, expected in expected_tensors.items():
        assert torch.equal(tensors[key], expected), key
    assert stages == expected_stages


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_killed_run_resumes_at_the_next_layer_and_ends_with_the_same_checkpoint(
    recipe, four_layer_model, artifacts, caplog
):
    args = [*RECIPES[recipe], f"model={four_layer_model}", *QUICK]
    killed = killed_run(args, artifacts)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    progress, lock = sorted((artifacts / "runs" / ".progress").iterdir(), key=lambda path: path.is_file())
    assert lock.name == f".{progress.name}.lock"  # its holder was killed: the file stays, its lock went with it
    assert sorted(p.name for p in progress.glob("layer-*.pt")) == ["layer-00000.pt", "layer-00001.pt"]

    assert main(["run", *args]) == 0
    assert f"resuming at layer {KILL_AFTER + 1}/{LAYERS}" in caplog.text
    assert not (artifacts / "runs" / ".progress").exists()  # removed once the run is published

    assert main(["run", *args, "resume=false", f"output.dir={artifacts / 'uninterrupted'}"]) == 0
    assert_same_checkpoint(artifacts / "runs", artifacts / "uninterrupted")
    injected("SIGKILL inside the layer walk", f"{recipe}, after layer {KILL_AFTER} is kept", "resumed", RESUMED)


def test_a_killed_moe_run_resumes_with_every_expert_equal(moe_model, artifacts, caplog):
    args = [*RECIPES["gptq"], f"model={moe_model}", *QUICK]
    assert killed_run(args, artifacts).returncode == -signal.SIGKILL
    assert main(["run", *args]) == 0
    assert f"resuming at layer {KILL_AFTER + 1}/" in caplog.text
    assert main(["run", *args, "resume=false", f"output.dir={artifacts / 'uninterrupted'}"]) == 0
    assert_same_checkpoint(artifacts / "runs", artifacts / "uninterrupted")
    injected("SIGKILL inside the layer walk", f"gptq on a MoE, after layer {KILL_AFTER} is kept", "resumed", RESUMED)


def test_a_changed_recipe_starts_over_and_says_why(four_layer_model, artifacts, caplog):
    args = [*RECIPES["gptq"], f"model={four_layer_model}", *QUICK]
    assert killed_run(args, artifacts).returncode == -signal.SIGKILL
    assert main(["run", *args, "stages.0.dampening=0.05"]) == 0
    out = caplog.text
    assert "the recipe changed since" in out and "starting over" in out
    assert "resuming" not in out


def test_a_killed_torchrun_resumes_every_rank_at_the_same_layer(four_layer_model, artifacts, tmp_path):
    """Both ranks die after layer 1; run again, both continue at layer 2 and the checkpoint equals one process's
    (FP8 static scales reduce maxima over ranks, which is exact: tests/compress/test_distributed.py)."""
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_RUN.format(kill_after=KILL_AFTER))
    resumable = tmp_path / "resumable.py"
    resumable.write_text("import sys\nfrom compress.__main__ import main\nsys.exit(main(sys.argv[1:]))\n")
    args = ["run", "recipe=fp8_static", f"model={four_layer_model}", *QUICK, "data.num_samples=8"]
    env = {"COMPRESS_ARTIFACTS": str(artifacts)}

    assert torchrun([str(script), *args], cwd=REPO, env=env).returncode != 0
    resumed = torchrun([str(resumable), *args], cwd=REPO, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count(f"resuming at layer {KILL_AFTER + 1}/{LAYERS}") == 2  # each rank, the same layer
    assert main([*args, "resume=false", f"output.dir={artifacts / 'one-process'}"]) == 0
    assert_same_checkpoint(artifacts / "runs", artifacts / "one-process")


class Killed(BaseException):
    """Stands for the SIGKILL above, in process: every other walking chain is checked the same way, cheaply."""


WALKS = {
    "autoround_int4": ["stages.0.group_size=32", "stages.0.iterations=3"],
    "awq_int4_kv_int8": ["stages.0.group_size=32"],
    "fp8_static": [],
    "nvfp4": [],
    "prune_2of4_gptq_int4": ["stages.1.group_size=32"],
    "rotate_gptq_int4": ["stages.1.group_size=32"],
    "smoothquant_gptq_w8a8": [],
}


@pytest.mark.parametrize("recipe", sorted(WALKS))
def test_every_walking_chain_resumes_to_the_same_model(recipe, tmp_path, caplog):
    from helpers import build_tiny_llama

    config = compose(recipe, WALKS[recipe])
    samples = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))

    def compressed(progress: WalkProgress | None) -> tuple[dict, list[dict]]:
        model = build_tiny_llama(num_hidden_layers=LAYERS, tie_word_embeddings=False)
        torch.manual_seed(0)
        summaries = compress_model(model, build_chain(config.stages), samples, batch_size=2, progress=progress)
        return model.state_dict(), [{k: v for k, v in s.items() if not k.endswith("seconds")} for s in summaries]

    interrupted = WalkProgress.open(tmp_path / "progress", {"test": recipe})
    keep = interrupted.save

    def keep_then_die(index, *args):
        keep(index, *args)
        if index == KILL_AFTER:
            raise Killed

    interrupted.save = keep_then_die
    with pytest.raises(Killed):
        compressed(interrupted)
    weights, summaries = compressed(WalkProgress.open(tmp_path / "progress", {"test": recipe}))
    assert f"resuming at layer {KILL_AFTER + 1}/{LAYERS}" in caplog.text
    expected_weights, expected_summaries = compressed(None)
    assert weights.keys() == expected_weights.keys()
    assert [key for key, value in expected_weights.items() if not torch.equal(weights[key], value)] == []
    assert summaries == expected_summaries


HOLDS_THE_LOCK = """
import sys
from compress.base.locks import FileLock
lock = FileLock(sys.argv[1], "the other run's walk").acquire()
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_folder_in_use_by_another_live_run_is_waited_for_or_left_to_it(tmp_path, caplog):
    """Two runs of one recipe and model map to one progress folder while the first's walk holds its lock. A run of
    the same settings waits (one line), touching none of its files meanwhile, then goes on from them; a run of other
    settings (another job of one sweep) does not wait and keeps no progress. Neither removes the folder while it is
    held. Before the lock, a second run read ``owner.json`` after the first removed it and ended with exit 4."""
    folder = tmp_path / "progress"
    folder.mkdir()
    (folder / "fingerprint.json").write_text(json.dumps({"test": "bits=3"}))
    (folder / "layer-00000.pt").write_bytes(b"the other run's layer")
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THE_LOCK, str(lock_beside(folder))],
        cwd=REPO, env=cli_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout.readline() == "held\n"
        assert WalkProgress.open(folder, {"test": "bits=4"}) is None  # other settings: no wait, no progress
        assert "in use by a run of other settings" in caplog.text
        WalkProgress(folder).remove()
        assert (folder / "layer-00000.pt").read_bytes() == b"the other run's layer"  # held by the other: kept
        opened: list[WalkProgress] = []
        waiter = threading.Thread(target=lambda: opened.append(WalkProgress.open(folder, {"test": "bits=3"})))
        waiter.start()
        while "waiting for the layer walk's progress" not in caplog.text:
            assert waiter.is_alive()
            waiter.join(0.01)
        assert (folder / "layer-00000.pt").read_bytes() == b"the other run's layer"  # untouched while it waits
        other.communicate("done\n", timeout=60)  # the other's walk ends
        waiter.join(timeout=60)
    finally:
        other.kill()
        other.wait()
    [progress] = opened
    assert (folder / "layer-00000.pt").exists()  # the same settings: it goes on from the other's progress
    assert caplog.text.count("waiting for") == 1
    progress.release()
    progress.remove()
    assert not folder.exists() and not lock_beside(folder).exists()
