"""The gate's own files are written whole or not at all: gate.json (the verdict CI reads), gate.md and the cached
baseline reference (``evals.divergence.save_reference``). A write cut short (a full disk, a kill) must leave the
previous file whole under its name and no temporary beside it: a stray ``.gate.json.partial`` or ``.reference.tmp``
would pile up in a reused gate folder or reference cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compress.evals import divergence
from compress.evals.gate.report import write_report
from compress.evals.gate.result import GateResult


def verdict(name: str) -> GateResult:
    return GateResult("pass", [], [], name, "baseline", "engine", None, {})


@pytest.mark.parametrize("torn_file", ["gate.json", "gate.md"])
def test_a_gate_file_write_cut_short_keeps_the_previous_verdict_and_leaves_nothing_behind(
    tmp_path, monkeypatch, torn_file
):
    """gate.json is what CI reads, gate.md the reviewer: torn, gate.md would say another verdict than gate.json."""
    write_report(verdict("first"), tmp_path)
    write_text = Path.write_text

    def torn(self: Path, text: str, *args, **kwargs) -> int:
        if torn_file in self.name:  # the staged temporary of that file
            write_text(self, text[: len(text) // 2])
            raise OSError(28, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError, match="No space"):
        write_report(verdict("second"), tmp_path)
    monkeypatch.undo()
    assert "candidate: `first`" in (tmp_path / "gate.md").read_text() or torn_file == "gate.json"  # md goes first
    assert json.loads((tmp_path / "gate.json").read_text())["candidate"] == "first"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gate.json", "gate.md"]


def test_a_reference_save_cut_short_keeps_the_cached_one_and_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "reference.safetensors"
    divergence.save_reference(path, {"indices": torch.arange(4)}, {"windows": "4"})
    save_file = safetensors.torch.save_file

    def torn(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:20])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", torn)
    with pytest.raises(OSError, match="No space"):
        divergence.save_reference(path, {"indices": torch.arange(8)}, {"windows": "8"})
    monkeypatch.undo()
    assert safetensors.torch.load_file(path)["indices"].tolist() == [0, 1, 2, 3]
    assert [entry.name for entry in tmp_path.iterdir()] == ["reference.safetensors"]
