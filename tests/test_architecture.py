"""The package's shape, checked from its source: layers, no import cycles, small files and functions.

Every module of ``lightning_gpuopt`` is parsed with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` included, since they are arrows all the same) and held to ``docs/architecture.md``:

* Layers, bottom to top: ``base`` (``perf/`` and the top-level helpers ``internals``, ``option_checks``,
  ``protocols``, ``resume``) -> ``precision/`` -> ``generation/`` -> ``model/``, ``data/`` -> ``checkpoint/``
  -> ``callbacks/``, ``strategies/`` -> ``run/`` -> ``cli/`` and the package root. A module imports its own group and
  lower layers only.
  ``model`` and ``data`` do not import each other, nor do ``callbacks`` and ``strategies``; the top-level
  modules within ``base`` may.
* No cycles between modules.
* One concept per module, sized by its concept: a library file over ``MAX_LINES`` lines is listed in
  ``LONG_FILES`` saying why it is still one concept; no function over ``MAX_FUNCTION_LINES`` lines of code
  (docstring left out) unless a ``# long:`` comment in it states why.
* No line over ``MAX_LINE_LENGTH`` columns.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = "lightning_gpuopt"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
MAX_LINES = 500  # one concept per module: past this, LONG_FILES says why it is still one
MAX_FUNCTION_LINES = 60
MAX_LINE_LENGTH = 120  # pyproject's ruff line-length


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    groups: frozenset[str]
    siblings_import_each_other: bool


# A group is a subpackage (``perf``), a top-level module (``resume``), or "" for the package root.
LAYERS = (
    Layer("base", frozenset({"perf", "internals", "option_checks", "protocols", "resume"}), True),
    Layer("precision", frozenset({"precision"}), True),
    Layer("generation", frozenset({"generation"}), True),
    Layer("model/data", frozenset({"model", "data"}), False),
    Layer("checkpoint", frozenset({"checkpoint"}), True),
    Layer("callbacks/strategies", frozenset({"callbacks", "strategies"}), False),
    Layer("run", frozenset({"run"}), True),
    Layer("cli", frozenset({"", "__main__", "cli"}), True),
)

# Library files allowed over MAX_LINES, with the reason they are one concept.
LONG_FILES: dict[str, str] = {
    "internals.py": "every private name of another library the package touches, each behind one small "
    "function, with the TOUCHED list and the check of it: the one file to read on an upgrade",
    "model/loss.py": "the loss from hidden states, chunk by chunk, in its three forms (the head in the compute dtype, "
    "its vocabulary shards under tensor parallelism, its GEMMs in float8): one chunk loop and one chunk arithmetic "
    "(the softmax, the one-hot, the padding, the compiled kernel) that the forms share",
    "cli/doctor.py": "the `gpuopt doctor` command: one short function per check, in the order its report prints "
    "them, and the command that runs them; what each check decides is computed in its own module (perf/, "
    "precision/, callbacks/)",
}


def _module_name(path: Path, root: Path) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their ``__init__``)."""
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import of the package in the module, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return [(t, line) for t, line in found if t == PACKAGE or t.startswith(PACKAGE + ".")]


def group_of(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def layer_of(group: str) -> Optional[tuple[int, Layer]]:
    for rank, layer in enumerate(LAYERS):
        if group in layer.groups:
            return rank, layer
    return None


def layer_violations(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports that point up a layer, across siblings, or from a module no layer lists."""
    problems = []
    for name, path in modules.items():
        own = layer_of(group_of(name))
        if own is None:
            problems.append(f"{name} is in no layer: add {group_of(name)!r} to LAYERS in tests/test_architecture.py "
                            "and to docs/architecture.md")
            continue
        for target, line in imports_of(name, path, modules):
            theirs = layer_of(group_of(target))
            if theirs is None or group_of(target) == group_of(name):
                continue
            (rank, layer), (their_rank, their_layer) = own, theirs
            if their_rank < rank or (their_rank == rank and layer.siblings_import_each_other):
                continue
            where = "a higher layer" if their_rank > rank else "a sibling group of the same layer"
            problems.append(f"{path.relative_to(root.parent)}:{line}: {name} ({layer.name}) imports {target} "
                            f"({their_layer.name}), {where}")
    return problems


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Cycles of the module import graph (one cycle per strongly connected component, as a path)."""
    graph = {
        n: sorted({t for t, _ in imports_of(n, p, modules) if t in modules and t != n}) for n, p in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(_path_through(sorted(component), graph))

    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def _path_through(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A cycle from the component's first module back to itself, for the message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def long_files(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    problems = []
    for path in modules.values():
        rel = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and rel not in LONG_FILES:
            problems.append(f"{PACKAGE}/{rel} has {lines} lines (> {MAX_LINES}): is it one concept? "
                            "Split it where it is two, or list it in LONG_FILES saying why it is one")
    return problems


def long_functions(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    problems = []
    for path in modules.values():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            doc = first.value if isinstance(first, ast.Expr) else None
            has_doc = isinstance(doc, ast.Constant) and isinstance(doc.value, str)
            start = first.end_lineno + 1 if has_doc and len(node.body) > 1 else first.lineno
            code = node.end_lineno - start + 1
            body = lines[node.lineno - 1 : node.end_lineno]
            if code > MAX_FUNCTION_LINES and not any("# long:" in line for line in body):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.name} has {code} lines of code "
                                f"(> {MAX_FUNCTION_LINES}): split it, or state why in a '# long:' comment")
    return problems


def long_lines(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """``file:line`` of every line over ``MAX_LINE_LENGTH`` columns."""
    return [f"{path.relative_to(root.parent)}:{n}: {len(line)} columns (> {MAX_LINE_LENGTH}): wrap it"
            for path in modules.values() for n, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > MAX_LINE_LENGTH]


# Architecture names: only the config maps a family's name to what the code asks (docs/architecture.md,
# "A model architecture"); every other module asks the config's capabilities and methods.
ARCH_HOME = "model/config.py"


def _families(config: Path = ROOT / ARCH_HOME) -> tuple[str, ...]:
    """The names of ``Arch = Literal[...]`` in the config, read from its source."""
    for node in ast.parse(config.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "Arch" for t in node.targets):
            return tuple(e.value for e in ast.walk(node.value.slice) if isinstance(e, ast.Constant))
    raise AssertionError(f"no `Arch = Literal[...]` in {config}")


ARCH_NAMES = (*_families(), "mistral", "gemma", "phi")  # the families, and the next ones asked for


def _names_an_architecture(node: ast.AST) -> bool:
    """An ``arch`` attribute or variable, ``x.get("arch")`` / ``x["arch"]``, or a family's name as a string."""
    if isinstance(node, ast.Attribute) and node.attr == "arch" or isinstance(node, ast.Name) and node.id == "arch":
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in ARCH_NAMES or node.value == "arch"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_an_architecture(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and _names_an_architecture(node.args[0])
    return isinstance(node, ast.Subscript) and _names_an_architecture(node.slice)


def architecture_tests(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ``match``) that test an architecture's name outside the config."""
    problems = []
    for path in modules.values():
        if path.relative_to(root).as_posix() == ARCH_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Match):
                operands = [node.subject]
            else:
                continue
            if any(_names_an_architecture(o) for o in operands):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: tests an architecture's name "
                                f"({ast.unparse(node)[:80]}): ask a capability or a method of GPTConfig instead")
    return problems


def test_every_module_is_in_a_layer_and_imports_downwards():
    problems = layer_violations(package_modules())
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    cycles = import_cycles(package_modules())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_library_file_over_300_lines():
    problems = long_files(package_modules())
    assert not problems, "\n".join(problems)


def test_long_file_exceptions_are_still_needed():
    modules = {p.relative_to(ROOT).as_posix(): p for p in package_modules().values()}
    stale = [rel for rel in LONG_FILES if rel not in modules or len(modules[rel].read_text().splitlines()) <= MAX_LINES]
    assert not stale, f"remove from LONG_FILES (gone or now short): {stale}"


def test_no_function_over_60_lines_without_a_reason():
    problems = long_functions(package_modules())
    assert not problems, "\n".join(problems)


def test_no_line_over_120_columns():
    problems = long_lines(package_modules())
    assert not problems, "\n".join(problems)


def test_no_architecture_name_is_tested_outside_the_config():
    assert {"gpt2", "llama", "qwen2"} <= set(ARCH_NAMES)
    problems = architecture_tests(package_modules())
    assert not problems, "\n".join(problems)


# The checks themselves, on a tiny package written for them: each must be able to fail.


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return package_modules(root)


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / PACKAGE
    return lambda files: _write(root, {"__init__.py": "", "perf/__init__.py": "", "model/__init__.py": "",
                                       "data/__init__.py": "", "strategies/__init__.py": "", **files})


def test_an_upward_import_inside_a_function_is_caught(fake, tmp_path):
    modules = fake({
        "model/module.py": "def f():\n    from lightning_gpuopt.strategies.choose import choose_strategy\n",
        "strategies/choose.py": "from lightning_gpuopt.model import module\n",
    })
    problems = layer_violations(modules, tmp_path / PACKAGE)
    expected = "lightning_gpuopt.model.module (model/data) imports lightning_gpuopt.strategies.choose"
    assert len(problems) == 1 and expected in problems[0]


def test_a_sibling_import_and_an_unknown_group_are_caught(fake, tmp_path):
    modules = fake({"model/a.py": "from ..data import b\n", "data/b.py": "", "newthing.py": ""})
    problems = layer_violations(modules, tmp_path / PACKAGE)
    assert any("imports lightning_gpuopt.data.b (model/data), a sibling group" in p for p in problems)
    assert any("lightning_gpuopt.newthing is in no layer" in p for p in problems)


def test_a_cycle_through_a_lazy_import_is_caught(fake):
    modules = fake({
        "model/gpt.py": "from lightning_gpuopt.model.config import C\ndef g():\n    from . import generation\n",
        "model/generation.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .gpt import GPT\n",
        "model/config.py": "",
    })
    assert import_cycles(modules) == [["lightning_gpuopt.model.generation", "lightning_gpuopt.model.gpt",
                                       "lightning_gpuopt.model.generation"]]


def test_long_files_and_functions_are_caught(fake, tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    modules = fake({"perf/big.py": "x = 1\n" * (MAX_LINES + 1), "perf/f.py": f"def f():\n    '''Doc.'''\n{body}",
                    "perf/g.py": f"def g():\n    # long: one table, row by row\n{body}"})
    assert [p.split(" has ")[0] for p in long_files(modules, tmp_path / PACKAGE)] == ["lightning_gpuopt/perf/big.py"]
    assert [p.split(": ")[1] for p in long_functions(modules, tmp_path / PACKAGE)] == ["f has 61 lines of code (> 60)"]


def test_long_lines_are_caught(fake, tmp_path):
    modules = fake({"perf/wide.py": "x = 1\n" + "y = '" + "a" * (MAX_LINE_LENGTH - 5) + "'\n",
                    "perf/ok.py": "z = '" + "a" * (MAX_LINE_LENGTH - 6) + "'\n"})
    assert long_lines(modules, tmp_path / PACKAGE) == [
        f"lightning_gpuopt/perf/wide.py:2: {MAX_LINE_LENGTH + 1} columns (> {MAX_LINE_LENGTH}): wrap it"]


def test_an_architecture_test_outside_the_config_is_caught(fake, tmp_path):
    modules = fake({
        "model/config.py": "def f(c):\n    return c.arch == 'llama'\n",  # the one place it may be asked
        "model/gpt.py": "def f(c):\n    return c.arch != 'gpt2'\n",
        "model/summary.py": "def f(p):\n    return p.get('arch') == 'llama'\n",
        "strategies/choose.py": "def f(c, m):\n    return m.config.arch in ('qwen2',) or 'llama' == c.family\n",
        "perf/ok.py": "def f(c):\n    return c.mlp == 'swiglu' and c.positions != 'learned'\n",
    })
    found = [p.split(": ")[0] for p in architecture_tests(modules, tmp_path / PACKAGE)]
    assert found == ["lightning_gpuopt/model/gpt.py:2", "lightning_gpuopt/model/summary.py:2",
                     "lightning_gpuopt/strategies/choose.py:2", "lightning_gpuopt/strategies/choose.py:2"]


def face_homes(root: Path = ROOT) -> dict[str, str]:
    """``{public name: path of the module defining it}`` for every name a subpackage face exports."""
    homes = {}
    for init in sorted(root.rglob("__init__.py")):
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
                path = node.module.removeprefix(PACKAGE + ".").replace(".", "/") + ".py"
                for alias in node.names:
                    homes[f"{_module_name(init, root)}.{alias.asname or alias.name}"] = path
    return homes


def test_faces_reexport_their_own_room_only():
    """A face hands on its own room's names: one public import path per name."""
    strays = []
    for public, path in face_homes().items():
        face = public.rpartition(".")[0].removeprefix(PACKAGE).lstrip(".").replace(".", "/")
        if face and not path.startswith(face + "/"):
            strays.append(f"{public} (defined in {path})")
    assert not strays, "faces exporting another room's names:\n" + "\n".join(strays)


def test_the_concept_table_names_the_home_of_every_public_name():
    """docs/architecture.md's table lists the module of every name a face exports, so a guess from it is right."""
    table = (ROOT.parent / "docs" / "architecture.md").read_text()
    table = table[table.index("## Where each concept lives"):]
    homes = {path for path in face_homes().values() if not (ROOT / path).with_suffix("").is_dir()}  # not a face
    missing = sorted(h for h in homes if f"`{h}`" not in table and f"`{h.rpartition('/')[0]}/`" not in table)
    assert not missing, "modules with public names that docs/architecture.md's concept table does not list: " + ", ".join(missing)
