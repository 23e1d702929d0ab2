"""The docs: the site builds strictly, every relative link resolves, and the README stays a first screen."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it (built once for the tests that read it)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: run `pip install -e \".[docs]\"` (the dev extra includes it)")
    out = tmp_path_factory.mktemp("site") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(), check=False)
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + result.stdout[-4000:] + result.stderr[-4000:]
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    absent = [name for name in lightning_zero.__all__ if f'id="{_defined_at(name)}"' not in api]
    assert not absent, f"public names missing from the API reference: {absent}"


# [Note: the API reference shows what a user calls]
# Inherited members where they are the class's own API (``ZeroEngine.step``), constructor signatures with their types,
# and no internals: what the engine reads of its options (``policies``), where its parameters live (``store``), the
# helpers the engine calls itself. Its docstrings are Markdown: a Sphinx role (":class:`X`") is shown as literal
# text, so they write ``X`` instead.
_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|exc|data|obj):`")
_INTERNALS = ("engine.engine.ZeroEngine.policies", "engine.engine.ZeroEngine.store", "config.ZeroConfig.bucket_elements",
              "tensor_parallel.warn_if_nothing_is_sliced", "tensor_parallel.count_tensor_parallel",
              # Lightning's hooks the strategies override are Lightning's API, not ours
              "lightning.trainer.strategy.ZeroStrategy.setup", "lightning.fabric.strategy.ZeroFabricStrategy.backward")


def test_no_page_shows_a_sphinx_role(site: Path) -> None:
    found = []
    for page in sorted(site.glob("**/*.html")):
        text = html.unescape(re.sub(r"<[^>]+>", "`", page.read_text(encoding="utf-8")))  # <code> as a backtick
        found += [f"{page.relative_to(site)}: {text[m.start():m.start() + 60]!r}" for m in _SPHINX_ROLE.finditer(text)]
    assert not found, (f"{len(found)} Sphinx roles shown as literal text (write ``Name`` in the docstring; "
                       "see [Note: the API reference shows what a user calls]):\n" + "\n".join(found[:40]))


def test_the_api_reference_shows_inherited_members_and_signatures_not_internals(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert f'id="{_defined_at("ZeroEngine")}.step"' in api  # whether defined in the class or inherited
    shown = [name for name in _INTERNALS if f'id="lightning_zero.{name}"' in api]
    assert not shown, f"internals in the API reference: {shown}"
    config = html.unescape(re.sub(r"<[^>]+>", "", _section(api, _defined_at("ZeroConfig"))))
    assert "reduce_bucket_size: Optional[Elements] = None" in config  # the constructor's signature, with types
    assert "default_factory" not in config and "STAGE3_DEFAULTS" not in config  # defaults as values


def _section(page: str, anchor: str) -> str:
    """The HTML of the entry ``anchor`` and its members, up to the next entry of the page."""
    start = page.index(f'id="{anchor}"')
    ids = re.finditer(r'id="(lightning_zero\.[\w.]+)"', page[start:])
    end = next((m.start() for m in ids if not m.group(1).startswith(anchor)), len(page) - start)
    return page[start:start + end]


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("_generate_options", ROOT / "docs" / "_generate_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_options_tables_are_generated_from_zeroconfig() -> None:
    generator = _generator()
    assert not generator.stale(), (f"options tables out of date in {generator.stale()}: run "
                                   f"`{generator.COMMAND}` (they are written from ZeroConfig's field docs)")


# [Note: no benchmark figure in an option's doc]
# An option's doc says what it does; what it costs on one machine (1.05x DDP's step, 5% slower) changes with the
# machine and the commit, and belongs to a docs page that names both (docs/options.md's notes, the results).
_FIGURE = re.compile(r"\d(?:\.\d+)?x\b|\d(?:\.\d+)? ?%")


def test_every_option_is_documented_once_in_one_group_without_figures() -> None:
    import dataclasses

    from lightning_zero.config import OPTION_GROUPS, ZeroConfig

    fields = {f.name: f for f in dataclasses.fields(ZeroConfig)}
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(set(grouped)) == sorted(grouped), "an option in two groups of OPTION_GROUPS"
    assert set(fields) <= set(grouped), f"ZeroConfig fields in no group: {set(fields) - set(grouped)}"
    docs = _generator()._attribute_docs(ZeroConfig)
    assert set(docs) == set(fields), f"ZeroConfig fields without a docstring: {set(fields) - set(docs)}"
    figures = {name: _FIGURE.findall(doc) for name, doc in docs.items() if _FIGURE.search(doc)}
    assert not figures, f"benchmark figures in field docs (see [Note: no benchmark figure ...] here): {figures}"
    factories = [name for name, f in fields.items() if f.default is dataclasses.MISSING]
    assert not factories, f"fields whose default is not a value the docs can show: {factories}"


def _defined_at(name: str) -> str:
    """The dotted path of the public name ``name`` where it is defined: the anchor of its API entry."""
    obj = getattr(lightning_zero, name)
    return f"{obj.__module__}.{obj.__qualname__}"


def _env() -> dict[str, str]:
    """The environment of the build: this checkout first on the path, the end-of-life banner off."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_the_package_cites_only_documents_in_the_repository() -> None:
    """A ``.md`` file a docstring or comment names exists in the repository (as given, or under ``docs/``)."""
    missing = []
    for path in sorted((ROOT / "lightning_zero").rglob("*.py")):
        for cited in re.findall(r"[\w./-]+\.md\b", path.read_text(encoding="utf-8")):
            if not (ROOT / cited).is_file() and not (ROOT / "docs" / cited).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, missing
