"""The README stays a short map and every relative link in the docs leads somewhere: a moved file or folder must
take its links along."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKDOWN_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: Path) -> list[str]:
    """Targets of ``[text](target)`` outside code, without URLs or in-page anchors."""
    text = INLINE_CODE.sub("", FENCED_BLOCK.sub("", markdown.read_text(encoding="utf-8")))
    targets = [target.split("#", 1)[0] for target in LINK.findall(text)]
    return [target for target in targets if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def test_readme_is_at_most_150_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


@pytest.mark.parametrize("markdown", MARKDOWN_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_to_existing_paths(markdown: Path):
    missing = [target for target in relative_links(markdown) if not (markdown.parent / target).exists()]
    assert not missing, f"{markdown.relative_to(ROOT)} links to missing paths: {missing}"


def test_link_finder_sees_links_and_skips_code(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "[a](docs/a.md#part) [web](https://example.com) [anchor](#top) `[code](not/a/link.md)`\n"
        "```\n[fenced](fenced.md)\n```\n[b](../b/)\n",
        encoding="utf-8",
    )
    assert relative_links(page) == ["docs/a.md", "../b/"]


def test_readme_gives_the_two_fresh_machine_commands_and_the_makefile_has_them():
    commands = set(re.findall(r"^(make (?:run|test))\b", README.read_text(encoding="utf-8"), re.MULTILINE))
    assert commands == {"make run", "make test"}
    targets = set(re.findall(r"^(\w+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE))
    assert {"run", "test"} <= targets


PROJECT_PATH = re.compile(r"`((?:tests|compress|evals|kernels|benchmarks|recipes)/[^`\s]*)`")


def named_project_paths(markdown: Path) -> list[str]:
    """Paths into the project written as inline code (``tests/evals/test_gate_verdicts.py``, ``evals/gate/``), with
    a test id or line suffix (``::name``, ``:12``) dropped; patterns (``<run-id>``, ``{md,json}``, ``*``) skipped."""
    paths = {re.sub(r"(::.*|:\d+)$", "", path) for path in PROJECT_PATH.findall(markdown.read_text(encoding="utf-8"))}
    return sorted(path for path in paths if not set(path) & set("<>{}*|"))


@pytest.mark.parametrize("markdown", MARKDOWN_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_paths_the_docs_name_exist(markdown: Path):
    """docs/gate.md once named a test file that did not exist; every module, test and recipe path a page names must."""
    missing = [path for path in named_project_paths(markdown) if not (ROOT / path).exists()]
    assert not missing, f"{markdown.relative_to(ROOT)} names missing paths: {missing}"


def test_the_path_finder_reads_inline_code(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("`tests/x/test_y.py::test_z`, `evals/gate/`, not tests/plain.py, `q/k/v` or `benchmarks/<id>.md`")
    assert named_project_paths(page) == ["evals/gate/", "tests/x/test_y.py"]


def module_map(readme: str) -> dict[str, tuple[list[str], set[str]]]:
    """``{layer: (folders, module names)}`` from README's module map (the table whose header is layer | folders |
    modules); a folder cell `` `checkpoint/` `` after `` `compress/model/` `` is read as ``compress/checkpoint/``."""
    rows = {}
    for line in readme.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`") or cells[0] in ("layer", "---"):
            continue
        folders, root = [], ""
        for folder in re.findall(r"`([^`]+)`", cells[1]):
            root = folder.split("/")[0] + "/" if "/" in folder.rstrip("/") else root
            folders.append(folder if folder.startswith(("compress/", "kernels/", "evals/")) else root + folder)
        rows[cells[0]] = (folders, set(re.findall(r"`(\w+)`", cells[2])))
    return rows


def test_the_module_map_lists_every_module_in_its_layers_folder():
    rows = module_map((ROOT / "README.md").read_text())
    assert rows, "README has no module map"
    missing = []
    for folder in ("compress", "evals", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            home = str(path.parent.relative_to(ROOT)) + "/"
            if not any(home in folders and path.stem in names for folders, names in rows.values()):
                missing.append(str(path.relative_to(ROOT)))
    assert missing == [], "add these to README's module map, in the row of their folder"


def test_the_module_map_reader_sees_a_missing_module():
    readme = "|---|---|---|\n| base | `compress/base/`, `grids/` | `errors`, `int_grid` |"
    rows = module_map(readme)
    assert rows == {"base": (["compress/base/", "compress/grids/"], {"errors", "int_grid"})}
