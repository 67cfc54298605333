"""ServerConfig: its checks, its trip through an API process's settings pipe, and the Ray app's
args that build it; engine arguments that roseray refuses."""

import dataclasses
import json

import pytest
from pydantic import ValidationError

from roseray.config import EngineConfig, ServerConfig
from roseray.llm import LLM
from roseray.openai_api.api_processes import APIProcessSettings
from roseray.ray_serve.app import AppArgs


@pytest.mark.parametrize("settings, message", [
    ({"port": -1}, "port must be in 0..65535"),
    ({"port": 65536}, "port must be in 0..65535"),
    ({"drain_timeout_s": -0.5}, "drain_timeout_s must be >= 0"),
    ({"drain_timeout_s": float("inf")}, "drain_timeout_s must be >= 0"),
    ({"max_body_bytes": 0}, "max_body_bytes must be at least 1"),
    ({"api_processes": 0}, "api_processes must be at least 1"),
    ({"stuck_after_s": 0}, "stuck_after_s must be > 0"),
    ({"log_level": "loud"}, "log_level must be one of"),
    ({"cors_origins": "https://a.example"}, "cors_origins must be a list"),
    ({"cors_origins": [""]}, "cors_origins must be non-empty strings"),
    ({"host": ""}, "host must be"),
])
def test_settings_out_of_range_are_refused_clearly(settings, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**settings)


def test_defaults_are_safe():
    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.api_key is None and not config.log_prompts
    assert config.cors_origins == () and config.api_processes == 1
    assert ServerConfig(api_key="").api_key is None  # an empty key is no key, not a key anyone can send


def test_settings_round_trip_through_the_api_process_pipe():
    settings = APIProcessSettings(
        EngineConfig(model="random:tiny", num_kv_blocks=64, max_model_len=512, engine_process=True),
        ServerConfig(host="0.0.0.0", port=8123, api_key="secret", served_model_name="tiny", log_prompts=True,
                     log_requests=True, drain_timeout_s=2.5, cors_origins=["https://a.example", "https://b.example"],
                     max_body_bytes=1000, api_processes=3, stuck_after_s=9.0, log_level="warning"),
        replica_name="Engine#abc", ticket_secret="ticket")
    data = settings.encode()
    fields = json.loads(data)  # JSON of the dataclasses' fields: nothing but data crosses the pipe
    assert set(fields) == {f.name for f in dataclasses.fields(APIProcessSettings)}
    assert set(fields["server"]) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(fields["engine"]) == {f.name for f in dataclasses.fields(EngineConfig)}
    decoded = APIProcessSettings.decode(data)
    assert decoded == settings and isinstance(decoded.server, ServerConfig) and isinstance(decoded.engine, EngineConfig)
    assert decoded.server.cors_origins == ("https://a.example", "https://b.example")
    plain = APIProcessSettings(EngineConfig(), ServerConfig())
    assert APIProcessSettings.decode(plain.encode()) == plain


def test_the_pipe_refuses_settings_it_does_not_know():
    fields = json.loads(APIProcessSettings(EngineConfig(), ServerConfig()).encode())
    fields["server"]["surprise"] = 1
    with pytest.raises(TypeError, match="surprise"):
        APIProcessSettings.decode(json.dumps(fields).encode())
    fields["server"] = {"port": -1}
    with pytest.raises(ValueError, match="port"):  # the worker checks what it is told, too
        APIProcessSettings.decode(json.dumps(fields).encode())


def test_ray_app_args_build_the_server_config():
    args = AppArgs(served_model_name="m", api_key="k", cors_origins=["https://a.example"], max_body_bytes=10,
                   drain_timeout_s=3, stuck_after_s=7, log_requests=True, log_prompts=True, tool_call_parser="mistral")
    assert args.server_config(api_processes=2) == ServerConfig(
        served_model_name="m", api_key="k", cors_origins=("https://a.example",), max_body_bytes=10,
        drain_timeout_s=3, stuck_after_s=7, log_requests=True, log_prompts=True, api_processes=2,
        tool_call_parser="mistral")
    assert AppArgs().server_config(api_processes=1) == ServerConfig()  # the same defaults
    with pytest.raises(ValidationError, match="drain_timeout_s must be >= 0"):  # ServerConfig's check, at parse
        AppArgs(drain_timeout_s=-1)
    with pytest.raises(ValidationError, match="max_body_bytes must be at least 1"):
        AppArgs(max_body_bytes=0)
    with pytest.raises(ValidationError, match="tool_call_parser must be one of hermes, llama3_json, mistral"):
        AppArgs(tool_call_parser="xml")


def test_trust_remote_code_is_refused_with_the_reason():
    with pytest.raises(TypeError, match="trust_remote_code .*roseray runs only its own model code"):
        EngineConfig.from_kwargs(model="random:tiny", trust_remote_code=True)
    with pytest.raises(TypeError, match="trust_remote_code"):
        LLM("random:tiny", trust_remote_code=True)
    assert "trust_remote_code" not in {f.name for f in dataclasses.fields(EngineConfig)}
