"""docs/load-testing.md's CPU example, run as written: `roseray serve --model random:tiny` and
the doc's locust command complete requests within its 20 s, with no failure."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "load-testing.md")

# locust is run as a subprocess only: importing it here would monkey-patch this process (gevent)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                reason="locust is not installed (the bench extra)")


def doc_command(pattern: str) -> list[str]:
    """The first command of the doc's shell blocks that matches `pattern`, continuation lines joined."""
    text = open(DOC).read().replace("\\\n", " ")
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if re.search(pattern, line):
                return shlex.split(line.split(" #")[0])
    raise AssertionError(f"no command matching {pattern!r} in {DOC}")


def test_the_cpu_example_completes_requests_in_20_seconds(tmp_path):
    serve = doc_command(r"roseray serve --model random:tiny")
    load = doc_command(r"locust -f locustfile.py")
    assert serve[0].endswith("roseray") and load[0].endswith("locust") and "20s" in load, (serve, load)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "roseray.cli", *serve[1:], "--port", str(port)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert server.poll() is None, "roseray serve exited"
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 120, interval=0.2, message="roseray serve did not become ready")
        args = load[1:]
        args[args.index("-H") + 1] = url
        args[args.index("--report-dir") + 1] = str(tmp_path / "report")
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "locust", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        wall_s = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(30)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["failures"]["total"] == 0, summary["failures"]
    assert summary["requests"]["succeeded"] > 0, summary["requests"]
    assert wall_s < 60, f"the doc's 20 s run took {wall_s:.0f} s"
