"""The command line: help, generate end to end, and serve's wiring to the server."""

import subprocess
import sys

import pytest

from roseray import cli


def test_generate_prints_text_and_finish_reason(capsys):
    assert cli.main(["generate", "--model", "random:tiny", "--prompt", "Hello", "--prompt", "Hi there",
                     "--max-tokens", "4", "--ignore-eos", "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 2 and out.count("4 tokens, finish_reason=length") == 2


def test_every_engine_field_is_a_flag_with_help():
    parser = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest: a for a in serve._actions}
    for name in cli.ENGINE_ARG_HELP:
        assert name in flags and flags[name].help, name
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--async-scheduling", "--max-num-seqs", "8"])
    config = cli.engine_config_from_args(args)
    assert config.enable_prefix_caching is False and config.async_scheduling is True and config.max_num_seqs == 8
    assert args.host == "127.0.0.1"  # loopback unless told otherwise


def test_serve_entry_point_imports(monkeypatch):
    called = {}
    monkeypatch.setattr("roseray.openai_api.standalone.run_standalone", lambda cfg, **kw: called.update(kw, cfg=cfg))
    monkeypatch.setenv("ROSERAY_API_KEY", "k")
    assert cli.main(["serve", "--port", "9", "--model", "random:tiny"]) == 0
    assert called["port"] == 9 and called["api_key"] == "k" and called["cfg"].model == "random:tiny"


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_help_explains(argv):
    out = subprocess.run([sys.executable, "-m", "roseray.cli", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout and len(out.stdout) > 300


def test_serve_help_explains_api_processes():
    out = subprocess.run([sys.executable, "-m", "roseray.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "--api-processes" in out.stdout and "SO_REUSEPORT" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "roseray.cli", "serve", "--api-processes", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "at least 1" in bad.stderr
