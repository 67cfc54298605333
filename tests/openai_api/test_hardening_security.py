"""Secure defaults (issue 6): the API key guards every route but /health and /ready and is
compared in constant time (401 in the OpenAI shape); everything binds loopback by default
and Ray's dashboard stays on localhost; CORS is closed unless origins are configured; no
prompt text reaches the logs unless asked for; nothing a client sends is unpickled,
torch.load-ed or eval-ed."""

import ast
import hashlib
import inspect
import logging
import pathlib

import httpx
import pytest
import yaml

from roseray import cli
from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api import auth
from roseray.openai_api.api import create_app
from tests.openai_api.helpers import MODEL, REPLICA, assert_openai_error, serving

REPO = pathlib.Path(__file__).resolve().parents[2]
KEY = "s3cret-key-for-tests"
OPEN_PATHS = {"/health", "/ready"}


@pytest.fixture(scope="module")
def keyed_server():
    config = EngineConfig(model=MODEL, num_kv_blocks=32, max_model_len=128, max_num_seqs=4)
    with serving(config, api_key=KEY, cors_origins=["https://app.example"]) as s:
        yield s


def routes_of(app) -> list[tuple[str, str]]:
    """(method, a concrete path) of every route the app serves."""
    found = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                found.append((method, route.path.replace("{model_id:path}", MODEL)))
    return found


# ---- API key -------------------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_the_probes(keyed_server):
    # `serving` builds its own app; a twin over the same engine lists the same routes
    routes = routes_of(create_app(keyed_server.engine, ServerConfig(api_key=KEY)))
    assert {path for _, path in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                                            "/health", "/ready", f"/v1/models/{MODEL}"}
    body = {"prompt": "x", "max_tokens": 2}
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        for method, path in routes + [("GET", "/nowhere"), ("POST", "/v1/embeddings"), ("GET", "/docs"),
                                      ("GET", "/openapi.json")]:
            kwargs = {"json": body} if method == "POST" else {}
            if path in OPEN_PATHS:
                assert client.request(method, path, **kwargs).status_code == 200, path
                continue
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                            {"authorization": f"Bearer {KEY}x"}, {"authorization": KEY},
                            {"authorization": f"Bearer {KEY[:-1]}"}, {"x-api-key": KEY}):
                refused = client.request(method, path, headers=headers, **kwargs)
                error = assert_openai_error(refused, 401)
                assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
                assert refused.headers["www-authenticate"] == "Bearer"
            allowed = client.request(method, path, headers={"authorization": f"Bearer {KEY}"}, **kwargs)
            assert allowed.status_code != 401, (method, path)
        # the scheme is case-insensitive, as RFC 7235 says
        ok = client.post("/v1/completions", json=body, headers={"authorization": f"bearer {KEY}"})
        assert ok.status_code == 200


def test_the_key_is_compared_in_constant_time(keyed_server, monkeypatch):
    """Every check goes through hmac.compare_digest on fixed-size SHA-256 digests: neither
    the key's bytes nor its length shape the time a wrong guess takes."""
    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        for token in ("x", KEY[:-1], KEY, KEY * 40):
            client.get("/v1/models", headers={"authorization": f"Bearer {token}"})
    assert len(calls) == 4
    expected = hashlib.sha256(f"bearer {KEY}".encode()).digest()
    assert all(len(a) == len(b) == 32 and b == expected for a, b in calls)
    # and compare_digest's answer is the decision: no other comparison lets a request in or keeps it out
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: False)
        assert client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 401
        monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: True)
        assert client.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 200


def test_roseray_api_key_from_the_environment(monkeypatch):
    from roseray.openai_api import standalone
    from roseray.ray_serve.app import resolve_api_key

    captured = {}
    monkeypatch.setattr(standalone, "run_standalone", lambda engine_config, config: captured.update(config=config))
    monkeypatch.setenv("ROSERAY_API_KEY", "from-env")
    assert cli.main(["serve", "--model", MODEL]) == 0
    assert captured["config"].api_key == "from-env"
    assert cli.main(["serve", "--model", MODEL, "--api-key", "from-flag"]) == 0
    assert captured["config"].api_key == "from-flag"
    # the Ray app: the config's key, else the replica's environment
    assert resolve_api_key(None) == "from-env" and resolve_api_key("cfg") == "cfg"
    monkeypatch.delenv("ROSERAY_API_KEY")
    assert resolve_api_key(None) is None
    monkeypatch.setenv("ROSERAY_API_KEY", "")
    assert resolve_api_key(None) is None  # an empty variable is no key


# ---- loopback defaults -----------------------------------------------------------------------------------
def test_everything_binds_loopback_by_default():
    assert cli.build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert ServerConfig().host == "127.0.0.1"  # what run_standalone, build_server and the API processes bind
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"


def test_serve_config_keeps_rays_dashboard_on_localhost(monkeypatch):
    """serve_config.yaml cannot set the dashboard's address: `serve run` starts Ray with
    ray.init's default, which is loopback, and the config must not open anything wider."""
    import ray
    from click.testing import CliRunner
    from ray.serve import scripts

    assert inspect.signature(ray.init).parameters["dashboard_host"].default == "127.0.0.1"
    # `serve run serve_config.yaml` up to its ray.init call: it passes no dashboard address
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(scripts.ray, "init", init)
    monkeypatch.setattr(scripts.ray, "is_initialized", lambda: False)
    result = CliRunner().invoke(scripts.cli, ["run", str(REPO / "serve_config.yaml")])
    assert isinstance(result.exception, RuntimeError) and str(result.exception) == "stop here", result.output
    assert len(calls) == 1 and "dashboard_host" not in calls[0] and "include_dashboard" not in calls[0]
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())

    def values(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from values(value)
        elif isinstance(node, list):
            for value in node:
                yield from values(value)
        else:
            yield node

    everything = [str(v) for v in values(config)]
    assert not any(v in ("0.0.0.0", "::", "*") for v in everything), everything
    assert not any("dashboard" in v for v in everything)


def test_serving_beyond_loopback_without_a_key_warns(caplog):
    from roseray.openai_api.standalone import build_server
    from roseray.runtime.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_config(EngineConfig(model=MODEL, num_kv_blocks=8, max_model_len=64))
    with caplog.at_level(logging.WARNING, logger="roseray.openai_api.standalone"):
        build_server(engine, ServerConfig(host="0.0.0.0", port=1))
        assert "without an API key" in caplog.text
        caplog.clear()
        build_server(engine, ServerConfig(host="0.0.0.0", port=1, api_key=KEY))
        build_server(engine, ServerConfig(port=1))
        assert "without an API key" not in caplog.text


# ---- CORS ----------------------------------------------------------------------------------------------
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


def test_cors_is_closed_by_default():
    config = EngineConfig(model=MODEL, num_kv_blocks=8, max_model_len=64)
    with serving(config) as s, httpx.Client(base_url=s.url, timeout=30) as client:
        origin = {"origin": "https://evil.example"}
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=origin)
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        preflight = client.options("/v1/completions", headers={**origin, **PREFLIGHT})
        assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_cors_allows_only_configured_origins_even_with_an_api_key(keyed_server):
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        good = {"origin": "https://app.example"}
        preflight = client.options("/v1/completions", headers={**good, **PREFLIGHT})  # no key: browsers send none
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in preflight.headers
        response = client.get("/v1/models", headers={**good, "authorization": f"Bearer {KEY}"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "https://app.example"
        assert REPLICA and "x-roseray-replica" in response.headers["access-control-expose-headers"].lower()
        bad = {"origin": "https://evil.example"}
        assert client.options("/v1/completions", headers={**bad, **PREFLIGHT}).status_code == 400
        response = client.get("/v1/models", headers={**bad, "authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in response.headers


# ---- no prompt text in the logs ------------------------------------------------------------------------------
SECRET = "zq-distinctive-prompt-7781"


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def traffic_with_the_secret(url: str, engine) -> None:
    """A distinctive prompt through every path: whole, streamed, chat, refused (400, too long),
    a client that leaves mid-stream, and a request whose model step fails."""
    with httpx.Client(base_url=url, timeout=30) as client:
        text = {"prompt": f"{SECRET} hello", "max_tokens": 3, "ignore_eos": True}
        assert client.post("/v1/completions", json=text).status_code == 200
        assert client.post("/v1/completions", json={**text, "stream": True}).status_code == 200
        chat = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 3, "ignore_eos": True}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert client.post("/v1/completions", json={**text, "prompt": SECRET * 40}).status_code == 400
        assert client.post("/v1/completions", json={**text, "stop": [""]}).status_code == 400
        with client.stream("POST", "/v1/completions", json={**text, "max_tokens": 100, "stream": True}) as r:
            next(r.iter_lines())
        model = engine.client.engine.runner.model  # the LLMEngine on its thread
        real_forward = model.forward
        model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
        try:
            assert client.post("/v1/completions", json=text).status_code == 500
        finally:
            model.forward = real_forward


@pytest.mark.parametrize("log_prompts", [False, True])
def test_no_prompt_text_in_logs_unless_enabled(log_prompts):
    capture = Capture()
    capture.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access", "uvicorn.error", "roseray")]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(capture)
        lg.setLevel(logging.DEBUG)
    try:
        config = EngineConfig(model=MODEL, num_kv_blocks=32, max_model_len=128, max_num_seqs=4)
        with serving(config, log_requests=True, log_prompts=log_prompts) as s:
            traffic_with_the_secret(s.url, s.engine)
    finally:
        for lg, level in saved:
            lg.removeHandler(capture)
            lg.setLevel(level)
    logged = "\n".join(capture.lines)
    assert "finished" in logged and "engine step failed" in logged  # the capture saw the server's own lines
    assert (SECRET in logged) == log_prompts


# ---- nothing a client sends is deserialised as code ----------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle", "joblib"}


def unsafe_uses(source: str) -> list[str]:
    """Imports of pickle-like modules and calls that run or unpickle data: torch.load,
    eval, exec, yaml.load (not safe_load), numpy.load(allow_pickle=...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"import {n}" for n in names if n and n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("eval", "exec", "torch.load", "yaml.load", "yaml.unsafe_load", "__import__"):
                found.append(name)
            if name.split(".")[-1] == "load" and any(k.arg == "allow_pickle" for k in node.keywords):
                found.append(name + "(allow_pickle)")
    return found


def test_no_pickle_torch_load_or_eval_anywhere_in_roseray():
    """Request bodies are parsed as JSON (FastAPI/pydantic; the router's hint with
    json.loads); weights load from safetensors only. No module of roseray or its kernels
    unpickles, torch.load-s or evals anything, so no client input can reach such a call."""
    files = [f for root in (REPO / "roseray", REPO / "roseray_kernels") for f in root.rglob("*.py")]
    assert len(files) > 30
    found = {str(f.relative_to(REPO)): unsafe_uses(f.read_text()) for f in files}
    assert {f: uses for f, uses in found.items() if uses} == {}
    # the scan finds what it looks for
    assert unsafe_uses("import pickle\nfrom dill import loads\nx = torch.load(p)\neval(s)\n"
                       "np.load(f, allow_pickle=True)\nyaml.load(t)\nyaml.safe_load(t)\n") == [
        "import pickle", "import dill", "torch.load", "eval", "np.load(allow_pickle)", "yaml.load"]
