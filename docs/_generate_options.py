"""Write the options tables of docs/options.md and README.md from ``ZeroConfig``'s field docs.

    python docs/_generate_options.py            # rewrite the tables in place
    python docs/_generate_options.py --check    # exit 1, naming the files, when a table is out of date

Each option is documented once: a field of ``lightning_zero.config.ZeroConfig`` with its docstring, or one of the
strategies' own arguments (``memory_budget``, ``process_group_backend``, ``timeout``, ``start_method``) in the
``Args:`` of ``ZeroStrategy``'s docstring (``ZeroAutoStrategy``'s for ``memory_budget``). ``OPTION_GROUPS`` in
``lightning_zero/config.py`` orders them by concern.
docs/options.md gets one table per group (option, type, default, the whole doc); the README one table (option,
default, the first paragraph of the doc). Only the text between ``<!-- options:start -->`` and
``<!-- options:end -->`` is written: the prose around it is the page's own. tests/test_docs.py fails when a table is
out of date.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- options:start -->", "<!-- options:end -->"
COMMAND = "python docs/_generate_options.py"
_ABSENT = inspect.Parameter.empty


class Option(NamedTuple):
    """One option as the tables show it."""

    name: str
    type: str
    default: str
    doc: str
    """The whole doc, as one line of Markdown (the first paragraph is the summary)."""
    summary: str


def options() -> dict[str, list[Option]]:
    """Every option, by group, in the order of ``OPTION_GROUPS``."""
    from lightning_zero.config import OPTION_GROUPS, ZeroConfig

    sources = _Sources()
    grouped = {group: [sources.option(name) for name in names] for group, names in OPTION_GROUPS.items()}
    unlisted = {f.name for f in dataclasses.fields(ZeroConfig)} - {o.name for rows in grouped.values() for o in rows}
    if unlisted:
        raise SystemExit(f"ZeroConfig fields in no group of OPTION_GROUPS: {sorted(unlisted)}")
    return grouped


class _Sources:
    """Where the options are documented: ``ZeroConfig``'s fields, and the strategies' signatures and ``Args:``."""

    def __init__(self) -> None:
        from lightning_zero.config import ZeroConfig
        from lightning_zero.lightning.fabric.strategy import ZeroFabricStrategy
        from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
        from lightning_zero.lightning.trainer.strategy import ZeroStrategy

        self.fields = {f.name: f for f in dataclasses.fields(ZeroConfig)}
        self.hints = typing.get_type_hints(ZeroConfig)
        self.field_docs = _attribute_docs(ZeroConfig)
        classes = (ZeroStrategy, ZeroAutoStrategy, ZeroFabricStrategy)
        self.strategies = {cls.__name__: inspect.signature(cls).parameters for cls in classes}
        self.strategy_hints = {
            **typing.get_type_hints(ZeroStrategy.__init__),
            **typing.get_type_hints(ZeroAutoStrategy.__init__),
        }
        self.arg_docs = {
            **_args_docs(inspect.getdoc(ZeroStrategy) or ""),
            **_args_docs(inspect.getdoc(ZeroAutoStrategy) or ""),
        }

    def option(self, name: str) -> Option:
        if name in self.fields:
            if name not in self.field_docs:
                raise SystemExit(f"ZeroConfig.{name} has no docstring: document it under the field.")
            return _option(name, self.hints[name], self.fields[name].default, self.field_docs[name])
        takers = [cls for cls, params in self.strategies.items() if name in params]  # by name, not through **kwargs
        if not takers or name not in self.arg_docs:
            raise SystemExit(
                f"`{name}` in OPTION_GROUPS is neither a ZeroConfig field nor documented in the `Args:` of "
                "ZeroStrategy or ZeroAutoStrategy."
            )
        doc = self.arg_docs[name]
        doc = f"{' and '.join(f'``{t}``' for t in takers)} only. {doc[:1].upper()}{doc[1:]}"
        return _option(name, self.strategy_hints[name], self.strategies[takers[0]][name].default, doc)


def _option(name: str, hint: Any, default: Any, doc: str) -> Option:
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n")]
    return Option(
        name, _type_text(hint), _default_text(default), _markdown(" ".join(paragraphs)), _markdown(paragraphs[0])
    )


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the annotated fields of ``cls`` (what mkdocstrings shows too)."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = str(after.value.value)
    return docs


def _args_docs(docstring: str) -> dict[str, str]:
    """The entries of a Google-style ``Args:`` section, each joined into one line."""
    docs: dict[str, str] = {}
    name = None
    in_args = False
    for line in docstring.splitlines():
        if line.strip() == "Args:":
            in_args = True
        elif in_args and line.strip() and not line.startswith(" "):
            in_args = False
        elif in_args and (entry := re.match(r"^ {4}\*{0,2}(\w+)(?: \([^)]*\))?: ?(.*)$", line)):
            name = entry.group(1)
            docs[name] = entry.group(2)
        elif in_args and name and line.startswith(" " * 8):
            docs[name] += " " + line.strip()
    return docs


def _type_text(hint: Any) -> str:
    """``hint`` as Markdown: its alternatives as code, joined with "or" (a ``|`` would split a table cell)."""
    return " or ".join(f"`{part}`" for part in _alternatives(hint))


def _alternatives(hint: Any) -> list[str]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return [text for arg in typing.get_args(hint) for text in _alternatives(arg)]
    if origin is typing.Literal:
        return [_value(arg) for arg in typing.get_args(hint)]
    return [_name(hint)]


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    if origin is None:
        return getattr(hint, "__name__", str(hint))
    if origin in (typing.Union, types.UnionType, typing.Literal):  # a tuple's items: no `|`, which splits a cell
        return f"Union[{', '.join(_alternatives(hint))}]"
    args = typing.get_args(hint)
    if getattr(origin, "__name__", "") == "Callable":
        return "Callable"
    inner = ", ".join("..." if arg is Ellipsis else _name(arg) for arg in args)
    return f"{origin.__name__}[{inner}]"


def _default_text(value: Any) -> str:
    if value is _ABSENT:
        return "(required)"
    if isinstance(value, datetime.timedelta):
        return f"{value.total_seconds() / 60:g} minutes"
    return f"`{_value(value)}`"


def _value(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:_}"
    return repr(value)


def _markdown(text: str) -> str:
    """A docstring's reST-style code (````x````) as Markdown's, with ``|`` escaped for a table cell."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def options_page(grouped: dict[str, list[Option]]) -> str:
    """The generated part of docs/options.md: one table per group."""
    parts = []
    for group, rows in grouped.items():
        lines = [f"## {group}", "", "| option | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{o.name}` | {o.type} | {o.default} | {o.doc} |" for o in rows]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def readme_table(grouped: dict[str, list[Option]]) -> str:
    """The generated part of README.md: one table, the first paragraph of each doc, links made relative to the
    repository root."""
    lines = ["| option | default | what it does |", "|---|---|---|"]
    lines += [f"| `{o.name}` | {o.default} | {_from_root(o.summary)} |" for rows in grouped.values() for o in rows]
    return "\n".join(lines)


def _from_root(text: str) -> str:
    """Links relative to docs/ as links relative to the repository root."""
    return re.sub(r"\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)", "](docs/", text)


def generated() -> dict[Path, str]:
    """Each file with its tables as this code writes them."""
    grouped = options()
    files = {ROOT / "docs" / "options.md": options_page(grouped), ROOT / "README.md": readme_table(grouped)}
    return {path: _replace_between_markers(path, table) for path, table in files.items()}


def _replace_between_markers(path: Path, table: str) -> str:
    text = path.read_text(encoding="utf-8")
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{path.relative_to(ROOT)}: needs one {START} and one {END} around its options table.")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def stale() -> list[str]:
    """The files whose tables differ from what this code writes (relative to the repository root)."""
    return [
        str(path.relative_to(ROOT)) for path, text in generated().items() if path.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out_of_date = stale()
        for name in out_of_date:
            print(f"{name}: the options table is out of date; run `{COMMAND}`", file=sys.stderr)
        return 1 if out_of_date else 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path, text in generated().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
