"""The engine in a process of its own: how it is started, and its `main`.

Why a process: in one process the engine's steps and the server's asyncio streams share
one GIL, so every streamed token's Python delays the next step. Here a child owns the model
and steps it back to back (engine_loop.py); the server keeps an EngineProcessClient per
pipe pair (process_client.py). The child is `python -m roseray.runtime.engine_process`
with two OS pipes per client (no multiprocessing start-method magic, no pickle: the
messages are messages.py's). The config comes first, on the first client's command pipe;
the child answers each client Ready (or StartFailed) once the model is loaded. If the
server's processes die, the child's next read or write fails and it exits.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import gc
import logging
import os
import subprocess
import sys
from multiprocessing.connection import Connection

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.runtime.engine_loop import client_pipes, serve_clients
from roseray.runtime.messages import EngineFailed, Ready, Start, StartFailed, decode

logger = logging.getLogger(__name__)

# An output pipe holds this much before the child's write blocks: every busy client gets the
# whole step, so a client that falls behind (a burst of admissions, a pause) stalls the engine
# for every client once its pipe is full; this holds well over a hundred steps of a full batch
OUTPUT_PIPE_BYTES = 512 * 1024
# The command pipe: an event loop writes its adds itself, and a write that does not fit waits
# (blocking that loop) until the child reads commands between two steps; this holds a burst of
# a full batch of long prompts
COMMAND_PIPE_BYTES = 512 * 1024


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (the model, torch, the tokenizer) out of the
    garbage collector's view: a full collection then scans only what steps allocate,
    instead of pausing a step for milliseconds. At exit they go back (gc.unfreeze), so that
    the interpreter's teardown frees them: frozen objects of Triton's nanobind extension would
    otherwise be reported as "nanobind: leaked ..." lines."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this runs
    atexit.register(gc.unfreeze)


def widen_pipe(fd: int, size: int) -> int:
    """Ask Linux to let the pipe of `fd` hold `size` bytes; returns what it holds now. Best
    effort: elsewhere, or past /proc/sys/fs/pipe-max-size or the user's pipe pages, the pipe
    keeps its size (a log line says so)."""
    set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_size is None or get_size is None:
        return 0
    try:
        return fcntl.fcntl(fd, set_size, size)
    except OSError as error:
        logger.info("could not grow an engine pipe to %d bytes (%s)", size, error)
        return fcntl.fcntl(fd, get_size)


def spawn_engine_process(config: EngineConfig,
                         num_clients: int = 1) -> tuple[subprocess.Popen, list[tuple[int, int]]]:
    """Start `python -m roseray.runtime.engine_process` with one pipe pair per client and
    send it the config (first, on the first client's command pipe). Returns the process
    and each client's (command pipe write end, output pipe read end); its ends are closed
    here. The child runs in a session of its own: a terminal's Ctrl-C reaches whoever
    started it, which stops it."""
    child_fds, client_fds, argv = [], [], []
    for _ in range(num_clients):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        widen_pipe(out_w, OUTPUT_PIPE_BYTES)
        widen_pipe(cmd_w, COMMAND_PIPE_BYTES)
        child_fds += [cmd_r, out_w]
        client_fds.append((cmd_w, out_r))
        argv += ["--commands-fd", str(cmd_r), "--outputs-fd", str(out_w)]
    level = logging.getLevelName(logging.getLogger("roseray").getEffectiveLevel())
    process = subprocess.Popen(
        [sys.executable, "-m", "roseray.runtime.engine_process", *argv,
         "--log-level", level if isinstance(level, str) else "INFO"],
        pass_fds=child_fds, stdin=subprocess.DEVNULL, start_new_session=True)
    for fd in child_fds:
        os.close(fd)
    with Connection(os.dup(client_fds[0][0]), readable=False) as first:  # a Connection closes its fd
        first.send_bytes(Start(config).encode())
    return process, client_fds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="roseray's engine process (started by EngineProcessClient, "
                                                 "or by `roseray serve --api-processes N`)")
    parser.add_argument("--commands-fd", type=int, action="append", required=True,
                        help="a client's command pipe (repeat with --outputs-fd for each client)")
    parser.add_argument("--outputs-fd", type=int, action="append", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if len(args.commands_fd) != len(args.outputs_fd):
        parser.error("give one --outputs-fd per --commands-fd")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s")
    pipes = [(Connection(c, writable=False), Connection(o, readable=False))
             for c, o in zip(args.commands_fd, args.outputs_fd)]
    try:
        start = decode(pipes[0][0].recv_bytes())
        if not isinstance(start, Start):
            raise ValueError(f"the engine process expected its config first, got {type(start).__name__}")
        engine = LLMEngine(start.config)
    except Exception as error:  # noqa: BLE001 - reported to the clients, which raise it
        logger.exception("the engine process could not start")
        for _, outputs in pipes:
            _send_quietly(outputs, StartFailed(type(error).__name__, str(error)).encode())
        return 1
    freeze_startup_objects()
    clients = client_pipes(pipes)
    for client in clients:
        ready = Ready(engine.model_name, engine.limits, os.getpid(), client.index, client.prefix)
        _send_quietly(client.outputs, ready.encode())
    try:
        serve_clients(engine, clients)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the server process is gone; the engine process exits")
    except Exception as error:  # noqa: BLE001 - a dead tensor-parallel rank: every client learns why
        logger.exception("the engine cannot go on; the engine process exits")
        for client in clients:
            _send_quietly(client.outputs, EngineFailed(repr(error)).encode())
        return 1
    return 0


def _send_quietly(outputs: Connection, data: bytes) -> None:
    try:
        outputs.send_bytes(data)
    except OSError:  # that client is gone; serve_clients detaches it
        pass


if __name__ == "__main__":
    raise SystemExit(main())
