"""The layers of dbsp_core, bottom to top, and the check that no module imports a module of a higher layer (every import statement, lazy ones inside functions too; ``if TYPE_CHECKING:`` blocks excepted) nor forms an import cycle.

A module may import modules of its own layer and of any layer below it. Each offending import is printed as
``file:line -> module``. A module that no entry of LAYERS covers fails the check too: a new module is placed
in a layer on purpose, not by accident.
"""

from __future__ import annotations

import ast
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "dbsp_core"

# Bottom to top. Each entry is a module or a package (all modules under it), relative to dbsp_core; a module takes
# the layer of the longest entry that covers it. "" is dbsp_core/__init__.py.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("base", ("errors", "envvars", "arrow_pool", "storage.formats", "_zset", "_storage"),
     "typed errors, DBSP_* settings (and the Arrow memory pool one of them chooses), the table of on-disk formats (constants) and the C core's extension modules "
     "(built from bindings/*.pyx): what every layer may raise, read, write or call"),
    ("values", ("zset", "layout", "aggregates", "codec", "metrics", "profile", "status", "progress", "rows"),
     "Z-sets over the C core, the shard layout, aggregate specs, the byte codecs of stored values, metrics, "
     "the per-operator profile and the status page, "
     "the progress line, and rows in users' forms made Arrow tables of an input's types"),
    ("state", ("trace", "storage"),
     "traces (indexed, integrated state) and the stores below a pipeline: page-file databases, step log, output "
     "log, snapshots by shard, shard moves, repair"),
    ("time", ("time",),
     "event time: watermarks, the time lineage of streams and the state cleanup it allows"),
    ("operators", ("operators",),
     "every operator (windows and temporal ones too), their builders and the StepContext they run in"),
    ("circuit", ("circuit",),
     "the Circuit / Stream builder API over the operators"),
    ("runtime", ("runtime",),
     "the driver (Pipeline) over executors that schedule operators, checkpoints, recovery, program changes and "
     "rescaling"),
    ("front ends", ("connectors", "sql"),
     "sources and sinks over a pipeline's output log, and SQL compiled into circuits"),
    ("surface", ("", "__main__", "demo", "nexmark", "run"),
     "the public package and what runs on top of it: the CLI, `dbsp run` (SQL-only pipelines), the demo and the "
     "Nexmark queries"),
]


def modules(root: str = ROOT) -> dict[str, str]:
    """Every module of the package: dotted name -> path (for an extension module, its .pyx in bindings/, named
    as setup.py names it: dbsp_core._<stem>)."""
    out = {}
    bindings = os.path.join(root, "bindings")
    for f in sorted(os.listdir(bindings)) if os.path.isdir(bindings) else ():
        if f.endswith(".pyx"):
            out[f"{PACKAGE}._{f[:-4]}"] = os.path.join(bindings, f)
    for base, _, files in os.walk(os.path.join(root, PACKAGE)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(base, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module`` (dotted, from the package), None when no entry covers it."""
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    best, best_len = None, -1
    for i, (_, entries, _) in enumerate(LAYERS):
        for e in entries:
            covers = rel == e or (e != "" and rel.startswith(e + "."))
            if covers and len(e) > best_len:
                best, best_len = i, len(e)
    return best


def imports(path: str, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module of the package) for every import statement of the file outside ``if TYPE_CHECKING:``
    blocks; a name is resolved to the longest known module it names (``from dbsp_core import zset`` is
    dbsp_core.zset, ``from dbsp_core import ZSet`` is dbsp_core itself)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                out.append((node.lineno, n))
    return sorted(set(out))


@functools.lru_cache(maxsize=None)
def check(root: str = ROOT) -> tuple[list[str], list[str], dict[str, set[str]]]:
    """(offending imports as ``file:line -> module (layer a imports layer b)``, modules no layer covers, the import
    graph) over the package under ``root``."""
    mods = modules(root)
    known = set(mods)
    bad, unplaced, graph = [], [], {m: set() for m in mods}
    for m, path in sorted(mods.items()):
        own = layer_of(m)
        if own is None:
            unplaced.append(m)
            continue
        if not path.endswith(".py"):  # Cython: its imports are C headers and the base layer's errors
            continue
        rel = os.path.relpath(path, root)
        for line, target in imports(path, m, known):
            if not m.startswith(target + "."):  # a package's own __init__ runs first anyway: no edge
                graph[m].add(target)
            other = layer_of(target)
            if other is not None and other > own:
                bad.append(f"{rel}:{line} -> {target} (layer {LAYERS[own][0]!r} imports layer {LAYERS[other][0]!r})")
    return bad, unplaced, graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_module_imports_a_higher_layer() -> None:
    bad, unplaced, _ = check()
    for line in bad:
        print(line)
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {unplaced}"
    assert not bad, f"{len(bad)} imports of a higher layer:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    found = cycles(check()[2])
    assert not found, "import cycles:\n" + "\n".join(", ".join(c) for c in found)


def test_the_check_sees_lazy_and_relative_imports(tmp_path) -> None:
    """The checker itself: an upward import inside a function, a relative one and one of the package's public
    surface are found, one under ``if TYPE_CHECKING:`` and downward ones are not, a module in no layer is
    reported, and so is the cycle the upward import closes."""
    files = {
        "dbsp_core/__init__.py": "",
        "dbsp_core/zset.py": "import os\n",
        "dbsp_core/errors.py": "def f():\n    from dbsp_core.zset import ZSet\n",
        "dbsp_core/operators/__init__.py": "",
        "dbsp_core/operators/base.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from dbsp_core.circuit import Stream\nfrom ..circuit import Circuit\n"),
        "dbsp_core/circuit.py": "import dbsp_core.operators.base\n",
        "dbsp_core/trace.py": "from dbsp_core import zset\nfrom dbsp_core import ZSet\n",
        "dbsp_core/nowhere.py": "",
    }
    for rel, text in files.items():
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    bad, unplaced, graph = check(str(tmp_path))
    assert sorted(b.split(" (")[0] for b in bad) == [
        "dbsp_core/errors.py:2 -> dbsp_core.zset",
        "dbsp_core/operators/base.py:4 -> dbsp_core.circuit",
        "dbsp_core/trace.py:2 -> dbsp_core",
    ]
    assert unplaced == ["dbsp_core.nowhere"]
    assert cycles(graph) == [["dbsp_core.circuit", "dbsp_core.operators.base"]]


if __name__ == "__main__":
    found, missing, g = check()
    print("\n".join(found))
    for m in missing:
        print(f"{m}: in no layer")
    for c in cycles(g):
        print(f"import cycle: {', '.join(c)}")
    sys.exit(1 if found or missing or cycles(g) else 0)
