"""The command line: help, generate end to end, serve's wiring to the server, and how it fails
and stops: one-line errors (exit 2 for usage under the subcommand's usage, 1 at run time), the
traceback only with --debug or ROSERAY_DEBUG=1, and Ctrl-C without a traceback or leak reports."""

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from roseray import cli
from roseray.config import EngineConfig, ServerConfig
from tests.conftest import free_port
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
ENV.pop("ROSERAY_DEBUG", None)
QUIET_EXIT_NOISE = ("Traceback", "KeyboardInterrupt", "nanobind", "leaked")


def roseray(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roseray.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def subparser(name: str) -> argparse.ArgumentParser:
    return cli._subparser(cli.build_parser(), name)


def test_generate_prints_text_and_finish_reason(capsys):
    assert cli.main(["generate", "--model", "random:tiny", "--prompt", "Hello", "--prompt", "Hi there",
                     "--max-tokens", "4", "--ignore-eos", "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 2 and out.count("4 tokens, finish_reason=length") == 2


def test_every_engine_field_is_a_flag_with_help():
    parser = cli.build_parser()
    flags = {a.dest: a for a in subparser("serve")._actions}
    for name in cli.ENGINE_ARG_HELP:
        assert name in flags and flags[name].help, name
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--async-scheduling", "--max-num-seqs", "8"])
    config = cli.engine_config_from_args(args)
    assert config.enable_prefix_caching is False and config.async_scheduling is True and config.max_num_seqs == 8
    assert args.host == "127.0.0.1"  # loopback unless told otherwise


def test_serve_builds_one_server_config(monkeypatch):
    called = {}
    monkeypatch.setattr("roseray.openai_api.standalone.run_standalone",
                        lambda engine_config, config: called.update(engine=engine_config, server=config))
    monkeypatch.setenv("ROSERAY_API_KEY", "k")
    assert cli.main(["serve", "--port", "9", "--model", "random:tiny", "--drain-timeout", "2.5", "--cors-origin",
                     "https://a.example", "--cors-origin", "https://b.example", "--log-requests",
                     "--max-body-bytes", "1000", "--no-docs", "--tool-call-parser", "hermes",
                     "--reasoning-parser", "qwen3"]) == 0
    assert called["engine"] == EngineConfig(model="random:tiny", reasoning_parser="qwen3")
    assert called["server"] == ServerConfig(port=9, api_key="k", drain_timeout_s=2.5, log_requests=True,
                                            cors_origins=("https://a.example", "https://b.example"),
                                            max_body_bytes=1000, enable_docs=False, tool_call_parser="hermes")
    monkeypatch.setattr("roseray.openai_api.api_processes.run_api_processes",
                        lambda engine_config, config: called.update(engine=engine_config, server=config) or 0)
    assert cli.main(["serve", "--api-processes", "3", "--no-engine-process"]) == 0
    assert called["server"].api_processes == 3 and called["engine"].engine_process is True  # its own process


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_has_help_with_its_default_once(command):
    out = roseray(command, "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: roseray {command} ")
    entries = help_entries(out.stdout)
    for action in subparser(command)._actions:
        for flag in action.option_strings:
            assert flag in entries, f"{flag} is missing from `roseray {command} --help`"
        entry = entries[action.option_strings[0]]
        assert action.help, f"{action.option_strings[0]} has no help"
        assert entry.count("default") <= 1, entry  # said once, by the help or by the formatter
        default = action.default
        if default not in (None, False, [], argparse.SUPPRESS) and isinstance(default, (int, float, str)):
            assert entry.count(f"(default: {action.default})") == 1, entry
    if command == "serve":
        assert "(default: 8000)" in entries["--port"] and "SO_REUSEPORT" in entries["--api-processes"]
    else:
        assert "(default: 64)" in entries["--max-tokens"]


def help_entries(text: str) -> dict[str, str]:
    """Each flag's entry in argparse's help (its lines joined), by each of its option strings."""
    entries, current = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            flags = [part.split()[0] for part in stripped.split("  ")[0].split(", ")]
            current = [stripped]
            for flag in flags:
                entries[flag] = current
        elif current is not None and line.startswith("      ") and stripped:
            current.append(stripped)
        else:
            current = None
    return {flag: " ".join(lines) for flag, lines in entries.items()}


def test_top_level_help_lists_the_subcommands():
    out = roseray("--help")
    assert out.returncode == 0
    for name in ("generate", "serve", "bench", "--debug"):
        assert name in out.stdout


@pytest.mark.parametrize("argv, message", [
    (["serve", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "--prompt", "x", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["serve", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["serve", "--api-processes", "0"], "--api-processes must be at least 1"),
    (["serve", "--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["serve", "--port", "70000"], "--port must be in 0..65535"),
    (["generate", "--prompt", "x", "--block-size", "3"], "--block-size must be a positive power of two"),
    (["generate"], "the following arguments are required: --prompt"),
    (["generate", "--prompt", "x", "--trust-remote-code"], "--trust-remote-code is not supported"),
    (["serve", "--reasoning-parser", "r2"], "--reasoning-parser must be one of qwen3, deepseek_r1"),
    (["serve", "--tool-call-parser", "xml"], "argument --tool-call-parser: invalid choice: 'xml'"),
])
def test_usage_errors_exit_2_under_the_subcommands_usage(argv, message):
    out = roseray(*argv)
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr
    assert lines[0].startswith(f"usage: roseray {argv[0]} ") and len(lines) == 2, out.stderr
    assert lines[1].startswith(f"roseray {argv[0]}: error: ") and message in lines[1], out.stderr


RUNTIME_ERRORS = [
    (["generate", "--prompt", "x", "--max-tokens", "-3"], "max_tokens"),
    (["generate", "--prompt", "x", "--model", "/no/such/model"], "/no/such/model"),
    (["serve", "--model", "/no/such/model", "--port", "0"], "/no/such/model"),
]
if not torch.cuda.is_available():
    RUNTIME_ERRORS.append((["generate", "--prompt", "x", "--device", "cuda"], "no usable CUDA device"))


@pytest.mark.parametrize("argv, message", RUNTIME_ERRORS)
def test_runtime_errors_are_one_line_and_exit_1(argv, message):
    out = roseray(*argv)
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"roseray {argv[0]}: error: ") and message in lines[0] and "--debug" in lines[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names the holder from Linux's /proc")
@pytest.mark.parametrize("extra", [[], ["--api-processes", "2"]])
def test_a_taken_port_is_one_line_naming_it_before_the_model_loads(extra):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = roseray("serve", "--port", str(port), "--model", "random:gpt2", *extra)
    assert out.returncode == 1, out.stderr
    holder = f"pid {os.getpid()} ({pathlib.Path('/proc/self/comm').read_text().strip()})"  # this test holds it
    assert out.stderr.splitlines() == [f"roseray serve: error: cannot listen on 127.0.0.1:{port}: {holder} listens "
                                       "there (stop it, or pick another --port) (--debug for the traceback)"]


def test_debug_flag_or_env_shows_the_traceback():
    argv = ["generate", "--prompt", "x", "--max-tokens", "-3"]
    runs = (roseray(*argv, "--debug"), roseray("--debug", *argv), roseray(*argv, env={**ENV, "ROSERAY_DEBUG": "1"}))
    for out in runs:
        assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr, out.stderr
        assert "ValueError" in out.stderr.splitlines()[-1]
    assert "Traceback" not in roseray(*argv, env={**ENV, "ROSERAY_DEBUG": "0"}).stderr


def interrupt_when(process: subprocess.Popen, ready, timeout: float = 90) -> tuple[int, str, str]:
    """SIGINT `process` once `ready()` holds; its exit code and the rest of its stdout and stderr."""
    def process_ready():
        assert process.poll() is None, process.communicate()[0]
        return ready()

    wait_until(process_ready, timeout=timeout, interval=0.05, message="ready")
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    return process.returncode, stdout or "", stderr or ""


def test_ctrl_c_on_serve_drains_without_traceback_or_leak_reports(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "roseray.cli", "serve", "--model", "random:tiny",
                                    "--port", str(port), "--num-kv-blocks", "32", "--drain-timeout", "2"],
                                   env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)

    def served() -> bool:
        try:
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  timeout=10)
        except httpx.HTTPError:
            return False
        return response.status_code == 200  # the engine stepped: its objects are frozen (gc.freeze) by now

    try:
        code, _, _ = interrupt_when(process, served)
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    assert code == cli.EXIT_INTERRUPTED, output
    assert "draining" in output and not any(noise in output for noise in QUIET_EXIT_NOISE), output


def test_ctrl_c_on_generate_exits_130_without_traceback():
    process = subprocess.Popen([sys.executable, "-m", "roseray.cli", "generate", "--model", "random:tiny",
                                *(["--prompt", "x"] * 64), "--max-tokens", "2000", "--ignore-eos",
                                "--num-kv-blocks", "8192"],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = []

    def generating() -> bool:  # tqdm's bar is on stderr once the model is loaded
        progress.append(os.read(process.stderr.fileno(), 65536).decode(errors="replace"))
        return "generate:" in "".join(progress)

    try:
        code, output, rest = interrupt_when(process, generating)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = "".join(progress) + rest
    assert code == cli.EXIT_INTERRUPTED, stderr
    assert "--- prompt" not in output and not any(noise in stderr for noise in QUIET_EXIT_NOISE), stderr
