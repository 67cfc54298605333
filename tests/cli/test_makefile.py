"""The Makefile's install steps (`make -n`: printed, not run): pip runs once, then not again
until pyproject.toml or the Makefile changes; torch stays pinned in every pip command; and
`make serve` installs what the README's client example needs (openai)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


@pytest.fixture()
def venv(tmp_path):
    """A stand-in .venv: its python exists, so only the install steps remain."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    return tmp_path


def planned(target: str, venv: pathlib.Path) -> list[str]:
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line]


@pytest.mark.parametrize("target, stamp", [("serve", ".installed-serve"), ("test", ".installed-test")])
def test_pip_runs_only_when_the_project_changed(venv, target, stamp):
    first = pip_installs(planned(target, venv))
    assert first, "a fresh venv gets its packages"
    assert all(re.search(r'"torch==[0-9.]+"', line) for line in first), first  # never an unpinned torch
    (venv / stamp).touch()  # what the install's last step does
    assert pip_installs(planned(target, venv)) == [], "nothing changed: no pip"
    os.utime(venv / stamp, (0, 0))  # older than pyproject.toml and the Makefile
    assert pip_installs(planned(target, venv)) == first


def test_serve_installs_the_openai_client(venv):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    with_openai = {name for name, requirements in extras.items() if any(r.startswith("openai") for r in requirements)}
    assert with_openai, "no extra installs openai"
    installed = set()
    for line in pip_installs(planned("serve", venv)):
        match = re.search(r'-e "\.\[([a-z,]+)\]"', line)
        if match:
            installed |= set(match.group(1).split(","))
    assert "serve" in installed and with_openai & installed, installed
