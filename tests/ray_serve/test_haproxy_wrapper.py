"""haproxy_env's HAProxy wrapper, with the real HAProxy binary and no Ray: it dies with the process
that started it, never execs itself, and answers HAProxy's own "not served" cases with a 503 in
the OpenAI error shape (on configs that Ray renders)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig

from roseray.ray_serve import haproxy_env
from roseray.ray_serve.background import alive, wait_gone
from tests.conftest import free_port
from tests.ray_serve.serve_run import port_is_free
from tests.waiting import wait_until

MINIMAL = """global
    maxconn 100
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend main
    bind 127.0.0.1:{port}
{rules}
    default_backend default_backend
backend default_backend
{default}
"""
RAY_NOT_FOUND = "    http-request return status 404 content-type text/plain lf-string \"Path '%[path]' not found.\""

# a parent that starts the wrapper as HAProxyManager does (asyncio's subprocess), prints the
# child's pid, then waits to be killed
PARENT = """
import asyncio, sys
async def main():
    proc = await asyncio.create_subprocess_exec(*sys.argv[1:])
    print(proc.pid, flush=True)
    await asyncio.sleep(3600)  # waits to be killed: the behaviour under test
asyncio.run(main())
"""


def _wait_listening(port: int, timeout_s: float = 20) -> None:
    wait_until(lambda: not port_is_free(port), timeout=timeout_s, interval=0.05, message=f"something listens on {port}")


@contextlib.contextmanager
def _real_haproxy(config: Path, port: int):
    """The real HAProxy on `config` (checked valid first), listening on `port`, killed on exit."""
    real = haproxy_env.find_haproxy()
    check = subprocess.run([real, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    server = subprocess.Popen([real, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port)
        yield
    finally:
        server.kill()
        server.wait(10)


def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    """`ray stop --force` SIGKILLs the HAProxyManager actor (and the raylet): nobody stops its
    HAProxy then, which kept serving port 8000 until killed by hand."""
    wrapper = haproxy_env.write_wrapper(str(tmp_path / "hap"))
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(MINIMAL.format(port=port, rules="", default=RAY_NOT_FOUND))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, wrapper, "-db", "-f", str(config)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    haproxy = int(parent.stdout.readline())
    try:
        _wait_listening(port)
        assert os.path.basename(open(f"/proc/{haproxy}/cmdline", "rb").read().split(b"\0")[0].decode()) == "haproxy"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert not wait_gone([haproxy], 10), "HAProxy outlived its parent"
        # its listener closes with it (another process of a busy box may take the free port after)
        wait_until(lambda: port_is_free(port), 5, interval=0.05, message=f"port {port} still taken")
    finally:
        for pid in (parent.pid, haproxy):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)


def test_a_wrapper_never_execs_itself(tmp_path, monkeypatch):
    """haproxy_env's variables exported twice in one shell: the second wrapper must wrap the real
    binary, not the first wrapper (which, at the same path, looped on execv forever)."""
    first = haproxy_env.write_wrapper(str(tmp_path / "hap"))
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", first)
    real = haproxy_env.find_haproxy()
    assert real != first and haproxy_env.wrapped_binary(real) is None
    second = haproxy_env.write_wrapper(str(tmp_path / "hap"))  # the same path again
    assert haproxy_env.wrapped_binary(second) == real
    out = subprocess.run([second, "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version")


def _rewrite(tmp_path: Path, text: str) -> str:
    """`text` as the wrapper leaves it for HAProxy (the wrapper then execs `true`)."""
    wrapper = haproxy_env.write_wrapper(str(tmp_path / "hap"), real_binary="/bin/true")
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    subprocess.run([wrapper, "-db", "-f", str(config)], check=True, timeout=30)
    return config.read_text()


def _returns(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"\s*http-request return status (404|503) ", line)
            and "healthcheck" not in line]


def _json_body(line: str) -> dict:
    return json.loads(shlex.split(line.split(" lf-string ", 1)[1])[0])


def _ray_config(directory: Path, backends: dict) -> str:
    """haproxy.cfg as Ray 2.60 writes it before each (re)start of HAProxy, for `backends`."""
    directory.mkdir()
    cfg = HAProxyConfig(socket_path=str(directory / "admin.sock"), server_state_base=str(directory),
                        server_state_file=str(directory / "state"), has_received_routes=True,
                        has_received_servers=True)
    api = HAProxyApi(cfg, backends, config_file_path=str(directory / "haproxy.cfg"))
    api._generate_config_file_internal()
    return (directory / "haproxy.cfg").read_text()


def test_not_routed_and_not_deployed_become_openai_503s_with_retry_after(tmp_path):
    app = BackendConfig(name="roseray", path_prefix="/",
                        servers=[ServerConfig("r1", "127.0.0.1", 30001, replica_id="SERVE_REPLICA::roseray#Engine#a")],
                        ingress_request_router_servers=[ServerConfig("router1", "127.0.0.1", 30100)])
    served = _rewrite(tmp_path, _ray_config(tmp_path / "app", {"roseray": app}))
    (router_failed, not_found) = _returns(served)
    reason = " hdr X-Serve-Reason %[var(txn.ingress_request_router_failed)] if "
    assert router_failed.startswith(haproxy_env.NOT_ROUTED + reason)
    assert set(_json_body(router_failed)["error"]) == {"message", "type", "param", "code"}
    assert "status 404 content-type text/plain" in not_found, "with the app routed, Ray's 404 stays"
    # before the app's routes exist (Serve starts HAProxy first, and a stop removes them first)
    starting = _rewrite(tmp_path, _ray_config(tmp_path / "none", {}))
    (not_deployed,) = _returns(starting)
    assert not_deployed == haproxy_env.NOT_DEPLOYED
    assert _json_body(not_deployed)["error"]["code"] == "not_ready"
    assert _rewrite(tmp_path, served) == served  # a reload's second pass changes nothing


def test_the_rewritten_answers_are_valid_haproxy_and_answer_as_promised(tmp_path):
    """HAProxy itself serves the two rewritten lines (the router's failure reason set by hand)."""
    port = free_port()
    rules = "\n".join([
        "    http-request set-var(txn.ingress_request_router_failed) str(router_non_200) if { path /routed }",
        haproxy_env.NOT_ROUTED + " hdr X-Serve-Reason %[var(txn.ingress_request_router_failed)]"
        " if { var(txn.ingress_request_router_failed) -m found }"])
    config = tmp_path / "haproxy.cfg"
    config.write_text(MINIMAL.format(port=port, rules=rules, default=haproxy_env.NOT_DEPLOYED))
    with _real_haproxy(config, port):
        for path, code in (("/routed", "not_routed"), ("/v1/models", "not_ready")):
            reply = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.headers["content-type"] == "application/json"
            assert reply.json()["error"]["code"] == code and reply.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"http://127.0.0.1:{port}/routed").headers["x-serve-reason"] == "router_non_200"


@pytest.mark.parametrize("argv, expected", [([], "0"), (["--min-draining-period-s", "30"], "30")])
def test_haproxy_env_sets_the_draining_period(tmp_path, capsys, argv, expected):
    assert haproxy_env.main(["--dir", str(tmp_path / "hap"), *argv]) == 0
    assert f"export {haproxy_env.MIN_DRAINING_PERIOD_ENV}={expected}\n" in capsys.readouterr().out


def test_haproxys_own_503_is_in_the_openai_shape_with_retry_after(tmp_path):
    """A backend with no server up (a replica gone before Serve drops it from the config):
    HAProxy's own HTML 503 becomes the OpenAI error shape with Retry-After."""
    port = free_port()
    rewritten = _rewrite(tmp_path, MINIMAL.format(port=port, rules="", default="    timeout queue 1s"))
    assert rewritten.count(haproxy_env.NO_SERVER) == 1
    assert _rewrite(tmp_path, rewritten) == rewritten  # a reload's second pass adds nothing
    config = tmp_path / "haproxy.cfg"
    with _real_haproxy(config, port):
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
        assert reply.headers["content-type"] == "application/json"
        assert reply.json()["error"] == {"message": "no engine replica is up to take the request",
                                         "type": "service_unavailable", "param": None, "code": "no_replica"}
