"""No module imports a layer above its own (docs/architecture.md, "Layers").

Every import statement under src/pipeserve counts, including imports inside functions
and under TYPE_CHECKING. api and stages are peers: neither imports the other (the
per-request context, the events and the request are below both).
"""

from __future__ import annotations

import ast
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
