"""Environment variables are read in roseray/envs.py only, each when it is used."""

import ast
import pathlib

import pytest

from roseray import envs

REPO = pathlib.Path(__file__).resolve().parents[2]
ENVS = REPO / "roseray" / "envs.py"
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(source: str) -> list[int]:
    """The lines of `source` that touch the process environment: os.environ, os.getenv and
    the like, or any of them imported by name from os (or posix)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            if any(alias.name in ENV_NAMES or alias.name == "*" for alias in node.names):
                lines.append(node.lineno)
    return lines


def test_the_check_sees_every_way_of_reading_the_environment():
    assert environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert environment_reads("import os\nos.getenv('A')\n") == [2]
    assert environment_reads("from os import environ\n") == [1]
    assert environment_reads("import os as o\no.environ['A'] = '1'\n") == [2]
    assert environment_reads("import os\nos.path.join('a')\nenv = {'environment': 1}\n") == []


def test_no_module_but_envs_reads_the_environment():
    modules = [p for folder in ("roseray", "roseray_kernels") for p in (REPO / folder).rglob("*.py")]
    assert ENVS in modules and len(modules) > 50
    offenders = [f"{path.relative_to(REPO)}:{line}" for path in modules if path != ENVS
                 for line in environment_reads(path.read_text())]
    assert not offenders, f"read the environment through roseray/envs.py instead: {offenders}"


def test_every_variable_is_read_when_used(monkeypatch):
    monkeypatch.delenv(envs.API_KEY_ENV, raising=False)
    assert envs.api_key() is None
    monkeypatch.setenv(envs.API_KEY_ENV, "")
    assert envs.api_key() is None  # empty: no key
    monkeypatch.setenv(envs.API_KEY_ENV, "k")
    assert envs.api_key() == "k"
    for value, expected in (("", False), ("0", False), ("false", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(envs.DEBUG_ENV, value)
        assert envs.debug() is expected, value
    monkeypatch.setenv(envs.ADD_FLUSH_ENV, "iteration")
    assert envs.add_flush() == "iteration"
    monkeypatch.delenv(envs.ROUTER_REPLICAS_ENV, raising=False)
    assert envs.router_replicas_per_node() == 1
    monkeypatch.setenv(envs.ROUTER_REPLICAS_ENV, "4")
    assert envs.router_replicas_per_node() == 4
    monkeypatch.delenv(envs.TP_ALL_REDUCE_ENV, raising=False)
    assert envs.tp_all_reduce() == "nccl"
    monkeypatch.setenv(envs.TP_ALL_REDUCE_ENV, "symmetric")
    assert envs.tp_all_reduce() == "symmetric"
    monkeypatch.setenv(envs.CUDA_VISIBLE_DEVICES_ENV, "0,1")
    assert envs.cuda_visible_devices() == "0,1"


@pytest.mark.parametrize("name", [n for n in dir(envs) if n.endswith("_ENV")])
def test_every_variable_is_documented(name):
    """Each name constant has its one-line comment just above it."""
    lines = ENVS.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(f"{name} = "))
    assert lines[index - 1].startswith("# "), name
