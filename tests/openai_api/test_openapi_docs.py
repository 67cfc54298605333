"""/openapi.json and /docs (Swagger UI): served by default, off with enable_docs=False,
behind the API key like every route but the probes. The served schema is valid OpenAPI 3.2
(its SSE events use 3.2's itemSchema), states 400 and never FastAPI's 422, and a tool can
load it from the app and test the app against it.

The routes here do not reach the engine: the app runs over a stand-in."""

from types import SimpleNamespace

import jsonschema_rs
import pytest
from hypothesis import settings
from starlette.testclient import TestClient

from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.api import create_app
from roseray.openai_api.protocol import REFUSED_KEY
from roseray.runtime.async_engine import AsyncEngineStats

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
from schemathesis.specs.openapi.definitions import OPENAPI_32  # noqa: E402

MODEL = "stand-in"
KEY = "sk-test-key"


async def _shutdown(drain_timeout_s: float) -> None:
    pass


def stand_in_engine() -> SimpleNamespace:
    model = SimpleNamespace(tokenizer=None, model_name=MODEL, max_model_len=None, config=EngineConfig(model=MODEL))
    return SimpleNamespace(stats=AsyncEngineStats(), check_health=lambda: None, is_ready=True, start=lambda: None,
                           shutdown=_shutdown, client=model)


def app(**kwargs):
    return create_app(stand_in_engine(), ServerConfig(**kwargs))


@pytest.fixture(scope="module")
def client():
    return TestClient(app())  # not entered: no lifespan, no engine loop


def test_the_schema_is_served_and_is_valid_openapi_3(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    schema = response.json()
    assert schema["openapi"].startswith("3.2.")
    errors = [str(error) for error in jsonschema_rs.Draft202012Validator(OPENAPI_32).iter_errors(schema)]
    assert errors == []
    assert schema == client.app.openapi()


def test_the_schema_states_400_not_422_and_the_refused_fields(client):
    schema = client.get("/openapi.json").json()
    statuses = {status for path in schema["paths"].values() for operation in path.values()
                for status in operation["responses"]}
    assert "422" not in statuses and "HTTPValidationError" not in schema["components"]["schemas"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][route]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
        assert "itemSchema" in responses["200"]["content"]["text/event-stream"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert REFUSED_KEY in fields["guided_whitespace_pattern"] and fields["guided_whitespace_pattern"]["type"] == "null"
    assert REFUSED_KEY not in fields["temperature"]


def test_swagger_ui_is_served(client):
    response = client.get("/docs")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in response.text and "/openapi.json" in response.text


def test_the_docs_can_be_turned_off():
    client = TestClient(app(enable_docs=False))
    for path in ("/docs", "/openapi.json", "/redoc"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error", path
    assert client.get("/health").status_code == 200


def test_with_an_api_key_the_docs_need_it_and_the_probes_do_not():
    client = TestClient(app(api_key=KEY))
    for path in ("/docs", "/openapi.json"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, path
    for path in ("/health", "/ready"):
        assert client.get(path).status_code == 200, path


# a tool reads the schema from the app itself and checks the read-only routes against it
served = schemathesis.openapi.from_asgi("/openapi.json", app())


@served.include(method="GET").parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, database=None)
def test_the_read_routes_keep_to_the_served_schema(case):
    case.call_and_validate()
