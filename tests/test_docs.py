"""The docs: the site builds strictly, every relative link resolves, and the README stays a first screen."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_zero

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

# [Note: which links are checked]
# Markdown links `[text](target)` and images outside fenced code blocks and inline code. A target with a scheme
# (https:, mailto:) is external and not checked here; everything else is a path relative to the file that holds
# it, optionally with `#anchor`. The anchors of README.md's links to its own headings are checked against
# GitHub's slugs; the anchors inside docs/ are checked by `mkdocs build --strict` (`validation.anchors: warn`).
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(path: Path) -> list[str]:
    """The link targets written in the markdown file ``path``."""
    return _LINK.findall(_prose(path.read_text(encoding="utf-8")))


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def test_the_readme_is_a_first_screen() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): move the reference to a page under docs/ "
        "and link it from the README")


# [Note: no figure that changes with every commit]
# The number of tests and the seconds the suite or its fast tier takes change with every commit and every machine: a
# page that quotes them is wrong soon after. The docs quote neither (the examples' run times are measured once, with
# the machine named).
_SUITE_FIGURES = re.compile(
    r"\b\d[\d,]* (?:tests )?(?:passed|skipped)\b|\d+-second fast tier|fast tier \((?:under|about|in) [^)]*\d"
)


def test_the_docs_quote_no_test_count_or_suite_duration() -> None:
    found = [(path.name, m.group(0)) for path in _markdown_files()
             for m in _SUITE_FIGURES.finditer(path.read_text(encoding="utf-8"))]
    assert not found, f"figures that change with every commit (see [Note: no figure ...] here): {found}"


def test_the_trainer_page_counts_the_registered_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    words = {9: "nine", 12: "twelve", 15: "fifteen"}
    names = [name for name in StrategyRegistry if name.startswith("zero")]
    assert f"These {words[len(names)]} names" in (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")


def test_the_declared_torch_range_is_bounded_holds_this_torch_and_is_the_readmes() -> None:
    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = Requirement(re.search(r'^\s*"(torch[^"]*)",', text, flags=re.MULTILINE).group(1)).specifier
    assert Version(torch.__version__.split("+")[0]) in declared
    low, high = (re.search(rf"{op}(\d+\.\d+)", str(declared)).group(1) for op in (">=", "<"))
    assert Version("2.15") not in declared  # a release nobody ran the tests on
    last = f"{high.split('.')[0]}.{int(high.split('.')[1]) - 1}"
    assert f"declares torch {low} to {last}" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in _markdown_files():
        text = _prose(path.read_text(encoding="utf-8"))
        headings = {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
        for target in _links(path):
            if _SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            if not file_part:
                if path.name == "README.md" and anchor not in headings:
                    broken.append(f"{path.relative_to(ROOT)}: #{anchor} (no such heading)")
                continue
            if not (path.parent / file_part).resolve().exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md") if not _SCHEME.match(t)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if p.resolve() not in linked and p.name not in {"index.md", "results.md", "development.md"}]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_option_is_in_both_options_tables() -> None:
    import dataclasses

    options = [f.name for f in dataclasses.fields(lightning_zero.ZeroConfig)]
    options += ["process_group_backend", "timeout", "start_method", "memory_budget"]  # the strategies' own
    for path in (ROOT / "README.md", ROOT / "docs" / "options.md"):
        rows = set(re.findall(r"^\| `(\w+)` \|", path.read_text(encoding="utf-8"), re.MULTILINE))
        missing = [name for name in options if name not in rows]
        assert not missing, f"{path.relative_to(ROOT)}: options without a row in its table: {missing}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: run `pip install -e \".[docs]\"` (the dev extra includes it)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + result.stdout[-4000:] + result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    absent = [name for name in lightning_zero.__all__ if f'id="{_defined_at(name)}"' not in api]
    assert not absent, f"public names missing from the API reference: {absent}"


def _defined_at(name: str) -> str:
    """The dotted path of the public name ``name`` where it is defined: the anchor of its API entry."""
    obj = getattr(lightning_zero, name)
    return f"{obj.__module__}.{obj.__qualname__}"


def _env() -> dict[str, str]:
    """The environment of the build: this checkout first on the path, the end-of-life banner off."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
