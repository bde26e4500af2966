"""The `pipeserve` command: validate | schema | serve | node | demo-models.

Exit codes: 0 success, 1 invalid configuration (or a failed command), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeserve import __version__
from pipeserve.config.problems import ConfigError, Problem, sort_problems

DEFAULT_CONFIG = Path("configs/default.yaml")
YAML_SUFFIXES = (".yaml", ".yml")
DEFAULT_FOLDERS = ("configs", "pipelines")


class UsageError(Exception):
    """A mistake in the command line (exit 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"pipeserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print_problems(exc.problems)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeserve", description="An LLM server declared in YAML."
    )
    parser.add_argument("--version", action="version", version=f"pipeserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser("validate", help="check server configs and pipeline YAML")
    validate.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or folders (default: configs/*.yaml and pipelines/*.yaml here)",
    )
    validate.add_argument(
        "--explain",
        action="store_true",
        help="also print, per model, the pipeline chosen (pipeline: auto) and the evidence",
    )
    validate.set_defaults(handler=cmd_validate)

    schema = commands.add_parser("schema", help="print the JSON Schema of the YAML files")
    schema.add_argument("--kind", choices=("config", "pipeline", "all"), default="all")
    schema.set_defaults(handler=cmd_schema)

    serve = commands.add_parser("serve", help="serve the models of a server config")
    serve.add_argument(
        "--config",
        type=Path,
        help="server config (default: $PIPESERVE_CONFIG or configs/default.yaml)",
    )
    serve.add_argument("--host", help="bind address (default: the config's server.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: the config's server.port)")
    serve.add_argument("--workers", type=int, help="gunicorn worker processes")
    serve.set_defaults(handler=cmd_serve)

    add_node_parser(commands)

    demo = commands.add_parser("demo-models", help="build the tiny offline demo models")
    demo.add_argument("--out", type=Path, help="output folder (default: the pipeserve cache)")
    demo.add_argument(
        "--family",
        action="append",
        dest="families",
        metavar="F",
        help="only this family (repeatable)",
    )
    demo.set_defaults(handler=cmd_demo_models)
    return parser


def add_node_parser(commands: Any) -> None:
    node = commands.add_parser(
        "node",
        help="join a cluster: hold ranks of sharded models for a serving machine",
        description="Run on each extra machine, with the same PIPESERVE_CLUSTER_TOKEN as the"
        " serving machine (docs/cluster.md).",
    )
    node.add_argument(
        "--cluster",
        default=os.environ.get("PIPESERVE_CLUSTER", "default"),
        help="cluster name announced on the LAN (default: $PIPESERVE_CLUSTER or 'default')",
    )
    node.add_argument(
        "--host",
        default="0.0.0.0",
        help="bind address (default: every interface, so that the serving machine can reach"
        " it; every request must be signed with the token; give one LAN address to restrict)",
    )
    node.add_argument("--port", type=int, default=7337, help="API port (default: 7337)")
    node.add_argument(
        "--memory",
        help="memory this machine offers, as bytes or a size ('8GiB'); default: what is available",
    )
    node.add_argument(
        "--advertise",
        action="append",
        default=[],
        metavar="ADDR",
        help="address to announce (repeatable; default: this machine's addresses)",
    )
    node.add_argument(
        "--no-announce",
        action="store_true",
        help="do not announce on the LAN (the serving machine names this node by address)",
    )
    node.add_argument(
        "--models", type=Path, help="where fetched model files are kept (default: the cache)"
    )
    node.set_defaults(handler=cmd_node)


def print_problems(problems: Sequence[Problem]) -> None:
    for problem in problems:
        print(problem, file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from pipeserve.config.validate import Validator, validate_paths

    files = collect_files(args.paths)
    validator = Validator()
    report = validate_paths(files, validator=validator)
    if report.problems:
        print_problems(sort_problems(report.problems))
        bad = len({p.file for p in report.problems})
        print(f"{len(report.problems)} problem(s) in {bad} file(s)", file=sys.stderr)
        return 1
    print(f"ok: {len(files)} file{'s' if len(files) != 1 else ''}")
    return explain_configs(files, validator) if args.explain else 0


def explain_configs(files: Sequence[Path], validator: object) -> int:
    """`validate --explain`: each config's models, their pipelines and the evidence."""
    from pipeserve.config.detect import DetectionError
    from pipeserve.config.explain import explain
    from pipeserve.config.loader import load_yaml
    from pipeserve.config.validate import Validator, detect_kind

    assert isinstance(validator, Validator)
    failed = 0
    for path in files:
        if detect_kind(load_yaml(path)) != "config":
            continue
        loaded, _ = validator.config(path)
        assert loaded is not None  # every file passed validation above
        try:
            print("\n".join(explain(loaded, validator)))
        except DetectionError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def collect_files(paths: Sequence[str]) -> list[Path]:
    """The YAML files to validate; a folder means its YAML files plus configs/ and pipelines/."""
    if not paths:
        defaults = [f for folder in DEFAULT_FOLDERS for f in _yaml_in(Path(folder))]
        if not defaults:
            raise UsageError(
                "nothing to validate: no configs/*.yaml or pipelines/*.yaml here (pass PATHs)"
            )
        return defaults
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = _yaml_in(path) + [f for sub in DEFAULT_FOLDERS for f in _yaml_in(path / sub)]
            if not found:
                raise UsageError(f"no YAML files in {text}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"no such file or folder: {text}")
    return list(dict.fromkeys(files))


def _yaml_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())


def cmd_schema(args: argparse.Namespace) -> int:
    from pipeserve.config.schema import json_schema

    print(json.dumps(json_schema(args.kind), indent=2))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    import logging

    from pipeserve import backend, blas
    from pipeserve.cluster.auth import cluster_token, token_problem
    from pipeserve.config.memory import parse_size
    from pipeserve.settings import Settings, pipeserve_home

    try:
        memory = parse_size(args.memory) if args.memory else None
    except ValueError as exc:
        raise UsageError(f"--memory: {exc}") from None
    token = cluster_token()
    problem = token_problem(token) or backend.install_problem()
    if problem or token is None:
        print(f"pipeserve node: refusing to start: {problem}", file=sys.stderr)
        return 1
    home = pipeserve_home()
    if backend.cpu_backend():  # ranks inherit the OpenBLAS preload, as local ranks do
        blas.reexec_with_openblas(Settings().blas, home)
    logging.basicConfig(
        level=os.environ.get("PIPESERVE_LOG_LEVEL", "info").upper(),
        format="%(asctime)s %(levelname)s node %(name)s: %(message)s",
    )
    from pipeserve.cluster.node import NodeSettings, serve_node

    settings = NodeSettings(
        cluster=args.cluster,
        host=args.host,
        port=args.port,
        memory=memory,
        advertise=list(args.advertise),
        announce=not args.no_announce,
        models=args.models or home / "cluster-models",
    )
    return serve_node(settings, token)


def cmd_serve(args: argparse.Namespace) -> int:
    from pipeserve.config.validate import load_server_config

    config = args.config or Path(os.environ.get("PIPESERVE_CONFIG") or DEFAULT_CONFIG)
    if not config.is_file():
        raise UsageError(f"no such config file: {config}")
    try:
        load_server_config(config)
    except ConfigError as exc:
        print_problems(exc.problems)
        print(f"pipeserve: refusing to start: {config} is invalid", file=sys.stderr)
        return 1
    from pipeserve.serving import serve

    result = serve(config_path=config, host=args.host, port=args.port, workers=args.workers)
    return result if isinstance(result, int) else 0


def cmd_demo_models(args: argparse.Namespace) -> int:
    from pipeserve.engine.weights.demo.build import build_demo_models

    try:
        paths = build_demo_models(args.out, args.families)
    except ValueError as exc:  # an unknown family
        raise UsageError(str(exc)) from exc
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
