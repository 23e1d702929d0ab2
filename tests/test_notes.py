"""Notes that do not drift: every reference to a Note names one that is defined, in the file it says.

A Note is a titled paragraph of a docstring or comment, GHC style. It is *defined* where its bracketed title opens a
paragraph: alone on its line (or followed by the paragraph's first words) after a blank line, a docstring's opening
quotes or, in a comment, after a line that is not comment text. Everywhere else the bracketed title is a
*reference*, often "see [...] in ``file.py``"; the file may be a basename or a path. A reference whose title ends in
``...`` names every Note whose title starts with what comes before. Titles and the words after them may wrap across
lines (comment markers and indentation are read as one space).
"""

from __future__ import annotations

import bisect
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
#: What is checked: the package, the tests, the benchmarks, the examples and the README.
SCOPE = ("lightning_zero", "tests", "benchmarks", "examples", "README.md")
SUFFIXES = (".py", ".md", ".yaml", ".yml")

# the opening bracket and the word are split so that this file holds no Note of its own
_OPEN = re.escape("[" "Note:")
_MENTION = re.compile(_OPEN + r"\s*(?P<title>[^\]\[]{1,200}?)\s*\]")
_WRAP = re.compile(r"\s*\n\s*(?:#+(?=\s|$))?\s*")  # a line break, its indentation and comment marker
_NAMED_FILE = re.compile(r"\s*in\s+`{0,2}(?P<file>[\w./-]+\.(?:py|md))\b")
_OPENS_LINE = re.compile(r"\s*(?P<marker>#\s*|[rbuf]?(?:\"\"\"|''')\s*)?")
_ELLIPSIS = ("...", "…")
NOTE = "[" "Note:"
"""A Note's bracket and word, for messages."""


@dataclass(frozen=True)
class Mention:
    """One bracketed Note title in a file: a definition or a reference (with the file it names, if any)."""

    path: str
    line: int
    title: str
    defines: bool
    named_file: Optional[str] = None
    alone: bool = False
    """Whether the title stands alone on its line (after indentation or a comment marker), as a definition does."""

    @property
    def where(self) -> str:
        """``path:line``."""
        return f"{self.path}:{self.line}"


def _unwrap(text: str) -> str:
    """``text`` as one line: each line break with its indentation and comment marker becomes one space."""
    return " ".join(_WRAP.sub(" ", text).split())


def _opens_paragraph(lines: list[str], index: int, prefix: str) -> bool:
    """Whether a title starting after ``prefix`` on line ``index`` opens a paragraph (is a definition)."""
    opened = _OPENS_LINE.fullmatch(prefix)
    if opened is None:
        return False  # words before it on its line
    marker = (opened.group("marker") or "").strip()
    if marker.endswith(('"""', "'''")):
        return True  # the first line of a docstring
    previous = lines[index - 1].strip() if index > 0 else ""
    if marker == "#":  # a comment: after code, a blank line or an empty comment line
        return not previous.startswith("#") or previous == "#"
    return previous == "" or (previous.endswith(('"""', "'''")) and len(previous) <= 4)


def mentions(text: str, path: str) -> list[Mention]:
    """Every bracketed Note title in ``text`` (the contents of ``path``), in order."""
    lines = text.splitlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    found = []
    for match in _MENTION.finditer(text):
        index = bisect.bisect_right(starts, match.start()) - 1
        prefix = text[starts[index] : match.start()]
        named = _NAMED_FILE.match(_unwrap(text[match.end() : match.end() + 200]))
        defines = named is None and _opens_paragraph(lines, index, prefix)
        alone = _OPENS_LINE.fullmatch(prefix) is not None and "\n" not in match.group() and not text[
            match.end() : starts[index + 1] - 1].strip()
        found.append(Mention(path, index + 1, _unwrap(match.group("title")), defines,
                             named.group("file") if named else None, alone))
    return found


def _files() -> list[Path]:
    """The files of :data:`SCOPE` that can hold Notes."""
    out = []
    for name in SCOPE:
        top = ROOT / name
        out += [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    return out


def all_mentions() -> list[Mention]:
    """The mentions of every file in :data:`SCOPE`."""
    return [m for p in _files() for m in mentions(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]


def _names(path: str, named: str) -> bool:
    """Whether ``named`` (a basename or a path, as a reference writes it) names the file ``path``."""
    return path == named or path.endswith("/" + named.lstrip("./"))


def _matches(reference: Mention, definition: Mention) -> bool:
    """Whether ``definition`` is a Note ``reference`` can mean (its title, or its prefix before an ellipsis)."""
    title = reference.title
    for dots in _ELLIPSIS:
        if title.endswith(dots):
            return definition.title.startswith(title[: -len(dots)].rstrip())
    return definition.title == title


def problem(reference: Mention, definitions: list[Mention]) -> Optional[str]:
    """What is wrong with ``reference`` and how to fix it, or ``None`` when it names a Note in the file it says."""
    candidates = [d for d in definitions if _matches(reference, d)]
    head = f"{reference.where}: {NOTE} {reference.title}]"
    if not candidates:
        close = difflib.get_close_matches(reference.title, sorted({d.title for d in definitions}), n=1, cutoff=0.6)
        hint = next((d for d in definitions if close and d.title == close[0]), None)
        fix = f"name {NOTE} {hint.title}] (defined at {hint.where})" if hint else "define it, or drop the reference"
        return f"{head} is defined nowhere; fix: {fix}"
    if reference.named_file is None or any(_names(d.path, reference.named_file) for d in candidates):
        return None
    where = ", ".join(d.where for d in candidates)
    fix = f"``{Path(candidates[0].path).name}``"
    return f"{head} names ``{reference.named_file}``, but it is defined at {where}; fix: write {fix}"


def test_every_note_reference_names_a_note_defined_in_the_file_it_names():
    found = all_mentions()
    definitions = [m for m in found if m.defines]
    problems = [p for m in found if not m.defines and (p := problem(m, definitions)) is not None]
    assert not problems, "broken Note references:\n" + "\n".join(problems)


def test_no_note_is_defined_twice():
    seen: dict[str, Mention] = {}
    twice = []
    for definition in (m for m in all_mentions() if m.defines):
        first = seen.setdefault(definition.title, definition)
        if first is not definition:
            twice.append(f"{NOTE} {definition.title}] at {first.where} and {definition.where}; fix: rename one")
    assert not twice, "Notes defined twice:\n" + "\n".join(twice)


def test_a_title_alone_on_its_line_opens_a_paragraph():
    # a definition glued to the paragraph before it would be read as a reference to a Note defined nowhere
    glued = [f"{m.where}: {NOTE} {m.title}] stands alone on its line but does not open a paragraph; fix: put a blank "
             "line (an empty comment line in a comment) before it" for m in all_mentions() if m.alone and not m.defines]
    assert not glued, "Note titles that look like definitions:\n" + "\n".join(glued)


_SECTIONS = re.compile(r'RESULTS\.md,(?P<names>(?:\s*(?:#\s*)?"[^"]+",?)+)')


def results_pointers() -> list[tuple[str, int, str]]:
    """``(path, line, section)`` of every ``benchmarks/RESULTS.md, "Section"`` pointer in the package."""
    found = []
    for path in sorted((ROOT / "lightning_zero").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in _SECTIONS.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found += [(path.relative_to(ROOT).as_posix(), line, _unwrap(name))
                      for name in re.findall(r'"([^"]+)"', match.group("names"))]
    return found


def test_the_results_sections_the_package_points_to_exist():
    # measured figures live in benchmarks/RESULTS.md only; the docstrings name its sections, which must not drift
    headings = [line.lstrip("#").strip() for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
                if line.startswith("#")]
    pointers = results_pointers()
    missing = [f"{path}:{line}: no heading of benchmarks/RESULTS.md starts with {name!r}; fix: name one of its "
               "headings" for path, line, name in pointers if not any(h.startswith(name) for h in headings)]
    assert not missing, "\n".join(missing)
    assert len(pointers) >= 5


def test_the_scan_sees_the_package_notes():
    # a matcher that found nothing would pass the tests above: the known Notes and references must be found
    found = all_mentions()
    defined = {(m.title, m.path) for m in found if m.defines}
    assert ("hybrid sharding and its traffic", "lightning_zero/comm/groups.py") in defined
    assert ("the order of one optimizer step", "lightning_zero/engine/engine.py") in defined
    assert len(defined) > 50 and sum(not m.defines for m in found) > 100


def test_the_matcher_reads_definitions_wrapped_references_and_named_files():
    open_ = NOTE
    text = "\n".join([
        '"""Module.', "", f"{open_} first one]", "Body.", "", f"{open_} second]", '"""',
        "x = 1", f"# {open_} a comment note] opens this comment,", f"# and see {open_} first", "# one] in",
        "# ``pkg/mod.py`` and", f"# {open_} second] in `other.py`.",
        "def f():", '    """Do it (see', f"    {open_} first one] in stage3/plan.py).", "", f"    {open_} third]",
        '    """',
    ])
    found = mentions(text, "pkg/mod.py")
    assert [(m.line, m.title, m.defines, m.named_file) for m in found] == [
        (3, "first one", True, None), (6, "second", True, None), (9, "a comment note", True, None),
        (10, "first one", False, "pkg/mod.py"), (13, "second", False, "other.py"),
        (16, "first one", False, "stage3/plan.py"), (18, "third", True, None),
    ]
    definitions = [m for m in found if m.defines]
    assert [problem(m, definitions) is None for m in found if not m.defines] == [True, False, False]
    assert "fix: write ``mod.py``" in problem(found[4], definitions)
    stray = Mention("a.py", 1, "frist one", False)
    assert f"defined nowhere; fix: name {NOTE} first one] (defined at pkg/mod.py:3)" in problem(stray, definitions)
    assert problem(Mention("a.py", 1, "sec...", False, "mod.py"), definitions) is None  # a prefix, in that file
    assert _names("lightning_zero/comm/groups.py", "comm/groups.py") and not _names("x/mygroups.py", "groups.py")
