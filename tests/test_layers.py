"""No module imports a layer above its own (docs/architecture.md, "Layers"), and no
modules import each other in a cycle.

Every import statement under src/pipeserve counts, including imports inside functions
and under TYPE_CHECKING. api and stages are peers: neither imports the other (the
per-request context, the events and the request are below both).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Lower rank = lower layer. A module may import its own layer and any lower one.
CORE, ENGINE, PIPELINE, CONFIG, SERVER, ROOT = range(6)
LAYERS: dict[str, int] = {
    # the protocol-neutral types and process helpers every layer shares
    "pipeserve": CORE,  # the package's own __init__
    "pipeserve.events": CORE,
    "pipeserve.request": CORE,
    "pipeserve.errors": CORE,
    "pipeserve.context": CORE,
    "pipeserve.constraint": CORE,
    "pipeserve.settings": CORE,
    "pipeserve.gevent_support": CORE,
    "pipeserve.blas": CORE,
    "pipeserve.backend": CORE,  # which MLX backend is installed; the device a model runs on
    # the YAML schema types (data only): engines read their options from them
    "pipeserve.config.models": CORE,
    "pipeserve.config.detect_rules": CORE,
    "pipeserve.config.memory": CORE,  # parses server.memory_budget (schema-level)
    "pipeserve.engine": ENGINE,
    # the typed fields of the JSON frames between processes and a job's codec (the
    # control channel in engine/sharding, the engine host's wire in server/remote)
    "pipeserve.wire_schema": ENGINE,
    # discovery, node agent, placement, model files: beside the engine, which places its
    # node-sharded groups through it
    "pipeserve.cluster": ENGINE,
    "pipeserve.stages": PIPELINE,
    "pipeserve.api": PIPELINE,
    "pipeserve.store": PIPELINE,  # the response store the Responses protocol reads and writes
    "pipeserve.config": CONFIG,  # validates YAML against the stage registry
    "pipeserve.server": SERVER,
    "pipeserve.app": ROOT,  # the composition root wires everything together
    "pipeserve.loading": ROOT,
    "pipeserve.live_app": ROOT,  # a worker's app, rebuilt in place by a config reload
    "pipeserve.reload": ROOT,  # SIGHUP: validate in the master, apply in the workers
    "pipeserve.serving": ROOT,
    "pipeserve.prefetch": ROOT,  # model sources fetched before forking (serving, reload)
    "pipeserve.cli": ROOT,
    "pipeserve.__main__": ROOT,
}
PEERS_APART = {"pipeserve.api", "pipeserve.stages"}  # same layer, no imports between them


def layer_of(module: str) -> tuple[str, int]:
    """(the LAYERS key that owns `module`, its rank): the longest matching prefix."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in LAYERS:
            return key, LAYERS[key]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every pipeserve import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.split(".")[0] == "pipeserve"]


def violations(src: Path = SRC) -> list[str]:
    problems = []
    for path in sorted((src / "pipeserve").rglob("*.py")):
        module = module_name(path, src)
        own_key, own_rank = layer_of(module)
        for line, target in imported(path, module):
            key, rank = layer_of(target)
            apart = {own_key, key} == PEERS_APART
            if rank > own_rank or apart:
                where = f"{path.relative_to(src.parent)}:{line}"
                problems.append(f"{where}: {module} ({own_key}) imports {target} ({key})")
    return problems


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert violations() == []


def test_the_check_sees_upward_sideways_and_lazy_imports(tmp_path: Path) -> None:
    package = tmp_path / "pipeserve"
    (package / "engine").mkdir(parents=True)
    (package / "api").mkdir()
    (package / "engine" / "bad.py").write_text(
        "def f():\n    from pipeserve.stages.base import Chain\n"
    )
    (package / "api" / "peer.py").write_text("from pipeserve.stages import x\n")
    (package / "api" / "fine.py").write_text("from pipeserve.events import Event\n")
    found = violations(tmp_path)
    assert len(found) == 2
    assert "pipeserve.api.peer (pipeserve.api) imports pipeserve.stages" in found[0]
    assert "pipeserve.engine.bad (pipeserve.engine) imports pipeserve.stages.base" in found[1]


# -- import cycles ---------------------------------------------------------------------


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of src/pipeserve -> the modules of src/pipeserve it imports (every
    import statement: module level, inside functions, under TYPE_CHECKING). `from P
    import name` is an import of the module P.name where that is a module, else of P."""
    files = {module_name(p, src): p for p in (src / "pipeserve").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for base, names in _imports(path, module):
            modules = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
            targets.update(modules or [base])
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def _imports(path: Path, module: str) -> Iterator[tuple[str, list[str]]]:
    """(module, names imported from it) per import statement; relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [alias.name for alias in node.names]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_modules_import_each_other_in_a_cycle() -> None:
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pipeserve"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "a.py").write_text("from pipeserve.engine import b\n")
    (package / "engine" / "b.py").write_text("def f():\n    from pipeserve.engine.a import x\n")
    (package / "engine" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n"
    )
    (package / "engine" / "d.py").write_text("import pipeserve.engine.c\n")
    (package / "engine" / "e.py").write_text("from pipeserve.engine import a\n")  # no cycle
    assert import_cycles(import_graph(tmp_path)) == [
        ["pipeserve.engine.a", "pipeserve.engine.b"],
        ["pipeserve.engine.c", "pipeserve.engine.d"],
    ]
