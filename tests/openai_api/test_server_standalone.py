"""`run_standalone` (what `roseray serve` runs): the OpenAI app over one in-process engine on
uvicorn, without Ray; it serves, logs no prompt text, and on SIGTERM drains and exits."""

import os
import signal
import subprocess
import sys

import httpx

from tests.conftest import free_port
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SERVER = """
from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.standalone import run_standalone
run_standalone(EngineConfig(model="random:tiny", num_kv_blocks=64, max_model_len=512),
               ServerConfig(port={port}, api_key="sesame", served_model_name="tiny", drain_timeout_s=2))
"""


def test_standalone_serves_and_drains_on_sigterm():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", SERVER.format(port=port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=60, interval=0.05, message="the standalone server became ready")
        auth = {"authorization": "Bearer sesame"}
        chat = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "zebra-secret"}],
                                "max_tokens": 4, "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        assert chat.headers["x-roseray-replica"].startswith("standalone@")
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10).status_code == 401
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down (lifespan: the engine drains and stops), then re-raises the signal
        assert proc.wait(30) in (0, -signal.SIGTERM)
        output = proc.stdout.read()
        assert "Application shutdown complete." in output
        assert "zebra-secret" not in output  # no prompt text in the logs by default
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
