"""The package's import graph: folders in layers, no import from a lower layer to a higher one, no circle.

[Note: the layers of the package]
Read bottom-up, the folders follow one training step's data path: ``stages`` (one policy per stage) -> ``memory``
(the host heap and the step's cost counters) -> ``comm`` (collectives, process groups, quantized exchanges: the only
caller of ``torch.distributed``'s process-group API) -> ``process`` (signals, shutdown, fault points, calls every
rank must make) -> ``shards`` (flat layout, parameter store, buckets, the sharded optimizer, host and disk tiers) ->
``activations`` (ZeRO-R) -> ``tensor_parallel`` and ``stage3`` (what is sliced and what is gathered around its use)
-> ``checkpoints`` (the state of all of it on disk) -> ``pretrained`` (weights from Hugging Face files) -> ``config``
(the options, read by the engine alone: it hands each component its own small policy) -> ``engine``
(``ZeroEngine``: one step composed from the above, without Lightning) -> ``lightning`` (the Trainer's and Fabric's
adapters: the only code that imports Lightning) -> ``estimate``, ``cli``, ``testing``. A module imports only from
its own folder or a lower layer; folders in one layer do not import each other. Every import counts, also one inside a function or under
``TYPE_CHECKING`` (an annotation that names a higher layer is a dependency too); only the test for circles
between modules leaves out imports made for annotations alone, which never run.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_zero"
LAYERS: list[tuple[str, ...]] = [
    ("stages",),
    ("memory",),
    ("comm",),
    ("process",),
    ("shards",),
    ("activations",),
    ("tensor_parallel", "stage3"),
    ("checkpoints",),
    ("pretrained",),
    ("config",),
    ("engine",),
    ("lightning",),
    ("estimate",),
    ("cli", "testing"),
    ("__init__",),
    ("__main__",),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path, typing_too: bool = True) -> list[tuple[int, str]]:
    """(line, module) for every import of a ``lightning_zero`` module in ``path``, wherever it is written (without
    ``typing_too``, not those under ``if TYPE_CHECKING:``)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if not typing_too and id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from lightning_zero.comm import collectives` imports a module
                full = f"{target}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else target))
    return [(line, name) for line, name in found if name.split(".")[0] == "lightning_zero"]


def _graph(typing_too: bool = True) -> dict[str, list[tuple[int, str]]]:
    return {_module_name(p): _imports(p, typing_too) for p in sorted(PACKAGE.rglob("*.py"))}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(folder: str) -> int:
    for index, folders in enumerate(LAYERS):
        if folder in folders:
            return index
    raise AssertionError(f"lightning_zero/{folder} is in no layer: add it to LAYERS in tests/test_layers.py")


def test_no_import_goes_up_or_sideways() -> None:
    wrong = []
    for module, imports in _graph().items():
        here = _folder(module)
        for line, target in imports:
            there = _folder(target)
            if there == here or target == "lightning_zero" and here in ("__main__", "testing"):
                continue
            if _layer(there) >= _layer(here):
                wrong.append(f"{module}:{line} imports {target} ({there} is not below {here})")
    assert not wrong, "Imports against [Note: the layers of the package]:\n" + "\n".join(wrong)


def test_no_circle_between_modules() -> None:
    graph = {m: sorted({t for _, t in imports if t != m}) for m, imports in _graph(typing_too=False).items()}
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for target in graph.get(module, []):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module])
    assert not circles, "Import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


#: Where ``lightning_zero.config`` may be imported: the engine derives each component's policy from it
#: (see [Note: one policy per component] in ``engine/policies.py``); the adapters, the estimate and the command
#: line take options.
READS_THE_CONFIG = ("config", "engine", "lightning", "estimate", "cli", "__init__")


def test_only_the_engine_and_above_read_the_config() -> None:
    wrong = [f"{module}:{line}" for module, imports in _graph().items() for line, target in imports
             if target == "lightning_zero.config" and _folder(module) not in READS_THE_CONFIG]
    assert not wrong, ("lightning_zero.config imported below the engine (give the component a policy of the fields "
                       "it reads, made in engine/policies.py):\n" + "\n".join(wrong))


def test_benchmarks_and_examples_do_not_import_tests() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{node.lineno}" for folder in ("benchmarks", "examples", "lightning_zero")
             for path in sorted((ROOT / folder).rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                 (getattr(node, "module", None) or name.name).split(".")[0] == "tests" for name in node.names)]
    assert not wrong, "Import from tests/ (use lightning_zero.testing or examples/): " + ", ".join(wrong)


def _where_imported(root: str, allowed: tuple[str, ...]) -> list[str]:
    """``path:line`` of every import of the top-level package ``root`` (or of an attribute chain ``root.x.y`` read
    from it) in the package, outside the folders or modules of ``allowed``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if any(module == f"lightning_zero.{a}" or module.startswith(f"lightning_zero.{a}.") for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                     [ast.unparse(node)] if isinstance(node, ast.Attribute) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if name == root or name.startswith(root + ".")]
    return found


def test_only_the_adapters_import_lightning() -> None:
    """See [Note: the layers of the package]: Lightning is behind one boundary, ``lightning/``; the engine and
    everything below it run without Lightning."""
    wrong = _where_imported("lightning", ("lightning",))
    assert not wrong, "Lightning imported outside lightning_zero/lightning/:\n" + "\n".join(wrong)


#: What other folders may use of ``torch.distributed``: its checkpoint library (the checkpoints' storage layer) and
#: DTensor's placements (the tensor-parallel plans); the process-group API is ``comm/``'s alone.
DISTRIBUTED_LIBRARIES = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def test_only_comm_calls_torch_distributed() -> None:
    wrong = [line for line in _where_imported("torch.distributed", ("comm",))
             if not any(line.split()[-1].startswith(library) for library in DISTRIBUTED_LIBRARIES)]
    assert not wrong, ("torch.distributed used outside lightning_zero/comm/ (call comm.collectives instead):\n"
                       + "\n".join(wrong))


# [Note: comments speak of the code]
# A comment or docstring says what the code does and why; where it came from is the CHANGELOG's and git's. A reader
# of the package has neither the issue tracker nor the sessions that wrote it, so citations of them are refused.
_HISTORY = [
    re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE),
    re.compile(r"\bPRs?\s*#?\d+"),
    re.compile(r"\bpull request\s*#?\d+", re.IGNORECASE),
    re.compile(r"\bsession\s+#?\d+", re.IGNORECASE),
    re.compile(r"\bcommit\s+[0-9a-f]{7,40}\b", re.IGNORECASE),
]
_COMMENT_ONLY = [re.compile(r"#\d{2,}\b")]  # "#42"; in docstrings a '#' is too often something else


def _prose(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, is_comment) for every comment and every docstring (a string alone as a statement) in ``path``."""
    text = path.read_text()
    found = [
        (tok.start[0], tok.string[1:], True)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value, False))
    return found


def test_comments_do_not_cite_history() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text, is_comment in _prose(path):
            for pattern in _HISTORY + (_COMMENT_ONLY if is_comment else []):
                for match in pattern.finditer(text):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not wrong, "Comments citing history (see [Note: comments speak of the code]):\n" + "\n".join(wrong)
