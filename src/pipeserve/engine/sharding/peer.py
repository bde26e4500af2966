"""A rank other than 0 of a sharded model: `python -m pipeserve.engine.sharding.peer`.

Started by rank 0 (group.py) with its settings and the group's secret token as one JSON
line on its stdin (`--settings=stdin`; a cluster node's ranks get them in their
environment), never on a command line: `ps` shows those on every machine. It ends when
its stdin does (rank 0, or the ssh session that started it, is gone). It connects to rank
0's control channel, joins the mx.distributed group, loads its share of the weights and
then replays rank 0's batch log step by step (lockstep.py) until rank 0 closes the
group or goes away. Any error ends the process: rank 0 sees the exit and gives the
group up. A rank on another machine cannot count on seeing rank 0 go (a cut link shows
no EOF, and a collective blocked on a lost peer never returns), so a watch thread ends
the rank when rank 0 has been silent too long: rank 0 pings every second, and a step
longer than step_timeout has already made rank 0 give the group up.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
SILENCE = 15.0  # seconds past the allowed step or start time before a rank gives up
HELLO_TIMEOUT = 10.0  # seconds for connecting to rank 0 and the whole handshake

log = logging.getLogger("pipeserve.sharding")
SETTINGS: dict[str, str] = {}  # PIPESERVE_SHARD_* from stdin


def setting(name: str) -> str:
    """A PIPESERVE_SHARD_* setting: from rank 0's line on stdin, else the environment."""
    return SETTINGS[name] if name in SETTINGS else os.environ[name]


def read_settings() -> None:
    """Rank 0's settings line; then a thread ends this rank when stdin ends."""
    line = sys.stdin.buffer.readline()
    if not line.endswith(b"\n"):
        os._exit(1)  # rank 0 went away before it sent them
    SETTINGS.update(json.loads(line))
    threading.Thread(target=_exit_at_end_of_stdin, daemon=True, name="stdin-watch").start()


def _exit_at_end_of_stdin() -> None:
    while sys.stdin.buffer.read(4096):
        pass
    log.info("rank 0 closed this rank's stdin; exiting")
    logging.shutdown()
    os._exit(0)


def die_with_parent() -> None:
    """Exit when the process that started this rank exits (local ranks only)."""
    parent = os.environ.get("PIPESERVE_SHARD_PARENT")
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent):  # it exited before prctl took effect
        os._exit(1)


class CoordinatorWatch:
    """Exits this process when rank 0 has been silent for longer than `limit` seconds."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.heard_at = time.monotonic()

    def heard(self, limit: float | None = None) -> None:
        self.heard_at = time.monotonic()
        if limit is not None:
            self.limit = limit

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            silent = time.monotonic() - self.heard_at
            if silent > self.limit:
                log.error("rank 0 silent for %.0f s (limit %.0f s): leaving the group",
                          silent, self.limit)  # fmt: skip
                logging.shutdown()
                os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", choices=["stdin", "environment"], default="environment")
    args, _labels = parser.parse_known_args(argv)  # --model, --rank: labels for ps
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(
        level=os.environ.get("PIPESERVE_LOG_LEVEL", "info").upper(),
        format=f"%(asctime)s %(levelname)s rank {os.environ.get('MLX_RANK')} %(name)s: %(message)s",
    )
    if args.settings == "stdin":
        read_settings()
    from pipeserve.engine.sharding.control import Connection
    from pipeserve.gevent_support import os_socket_class

    host, port = setting("PIPESERVE_SHARD_CONTROL").rsplit(":", 1)
    sock = os_socket_class()()
    sock.settimeout(HELLO_TIMEOUT)
    sock.connect((host, int(port)))
    conn = Connection(sock)
    rank = int(os.environ["MLX_RANK"])
    options = json.loads(setting("PIPESERVE_SHARD_OPTIONS")).get("sharding") or {}
    watch = CoordinatorWatch(float(options.get("start_timeout", 300.0)) + SILENCE)
    threading.Thread(target=watch.run, daemon=True, name="coordinator-watch").start()
    try:
        shake_hands(conn, rank)
    except Exception as exc:  # not rank 0, or not in time: nothing more is sent
        log.error("rank %d: the control channel's handshake failed: %s", rank, exc)
        return 1
    try:
        return serve_rank(conn, rank, watch)
    except Exception as exc:
        log.exception("rank %d failed", rank)
        try:
            conn.send_json({"error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1


def shake_hands(conn: object, rank: int) -> None:
    """Prove this rank holds the group's token and check that rank 0 does (frames.py);
    from then on every frame on `conn` carries a MAC."""
    from pipeserve.engine.sharding.control import Connection
    from pipeserve.engine.sharding.frames import HELLO_MAX, Handshake

    assert isinstance(conn, Connection)
    shake = Handshake(setting("PIPESERVE_SHARD_TOKEN"), rank)
    conn.send_json(shake.hello(os.getpid()))
    conn.send_json(shake.answer_rank0(conn.recv_json(HELLO_TIMEOUT, HELLO_MAX)))
    conn.session = shake.session(is_rank0=False)
    conn.sock.settimeout(None)


def serve_rank(conn: object, rank: int, watch: CoordinatorWatch) -> int:
    import mlx.core as mx

    from pipeserve.config.models import EngineOptions
    from pipeserve.engine.sharding.control import ChannelClosed, Connection
    from pipeserve.engine.sharding.load import load_shard, weight_bytes
    from pipeserve.engine.sharding.lockstep import PeerBatch, replay

    assert isinstance(conn, Connection)
    options = EngineOptions.model_validate_json(setting("PIPESERVE_SHARD_OPTIONS"))
    assert options.sharding is not None
    if not os.environ.get("MLX_HOSTFILE"):
        fd, path = tempfile.mkstemp(prefix="pipeserve-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(setting("PIPESERVE_SHARD_RING"))
        os.environ["MLX_HOSTFILE"] = path
    group = mx.distributed.init(strict=True, backend=options.sharding.backend)
    model = load_shard(Path(setting("PIPESERVE_SHARD_MODEL_DIR")), options, group)
    total, layers = weight_bytes(model)
    grammar = grammar_compiler(Path(setting("PIPESERVE_SHARD_MODEL_DIR")))
    conn.send_json({"rank": rank, "weight_bytes": total, "layer_weight_bytes": layers})
    kind, seed = conn.recv_obj()
    if kind != "start":
        raise RuntimeError(f"expected start, got {kind!r}")
    mx.random.seed(seed)
    watch.heard(options.sharding.step_timeout + SILENCE)
    batch = PeerBatch(model, options, grammar)
    step = 1
    try:
        while True:
            message = conn.recv_obj()
            watch.heard()
            if message[0] == "ping":
                continue
            if not replay(batch, message, step):
                break
            watch.heard()
            step += 1
    except ChannelClosed as exc:
        log.info("rank %d: the control channel ended (%s); exiting", rank, exc)
    return 0


def grammar_compiler(model_dir: Path) -> object:
    """Structured output's compiler for this model, as rank 0 builds it (engine/runtime.py);
    its llguidance tokenizer is built in the background from now on."""
    from pipeserve.engine.sampling.grammar import GrammarCompiler
    from pipeserve.engine.weights.loader import eos_token_ids, load_tokenizer, read_config

    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(tokenizer, model_dir)
    compiler = GrammarCompiler(tokenizer, read_config(model_dir).get("vocab_size"), eos)
    compiler.warm_up()
    return compiler


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip MLX's thread teardown at interpreter exit
