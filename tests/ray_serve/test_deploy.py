"""deploy/ cannot rot silently: the image, the KubeRay manifest and the guide against the code.

No Docker and no Kubernetes here. The Dockerfile is parsed and its essentials checked (pins,
the serving ENV, USER, EXPOSE, COPY sources); the one command whose result matters most, the
wheel build, is run for real from exactly the files the Dockerfile copies. The manifest's
serveConfigV2 is validated by Ray Serve's own schema and roseray's AppArgs, and must equal
what deploy/render_rayservice.py renders from serve_config.yaml.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import yaml
from ray.serve._private import constants as serve_constants
from ray.serve.schema import ServeDeploySchema

from roseray.ray_serve import haproxy_env

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
MANIFEST = REPO / "deploy" / "kuberay" / "rayservice.yaml"
GUIDE = REPO / "deploy" / "README.md"
SERVE_CONFIG = REPO / "serve_config.yaml"

APP_LABEL = {"app.kubernetes.io/name": "roseray"}
PORT_RANGE_VARS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
# What the manifest sets on top of the image's serving env, each for a reason in its comments.
MANIFEST_EXTRA_ENV = {"RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"}
HAPROXY_SIDE_PORTS = (serve_constants.RAY_SERVE_HAPROXY_STATS_PORT, serve_constants.RAY_SERVE_HAPROXY_METRICS_PORT)
RAY_CLIENT_PORT, GCS_PORT, DASHBOARD_PORT = 10001, 6379, 8265


def _load_render():
    spec = importlib.util.spec_from_file_location("render_rayservice", REPO / "deploy" / "render_rayservice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


# ---- Dockerfile parsing -------------------------------------------------------------------------

def parse_dockerfile(text: str) -> list[tuple[str, str, str]]:
    """(INSTRUCTION, arguments, stage name) per instruction. Joins `\\` continuations and drops
    comment lines inside them, as Docker does; heredocs are not used (and rejected)."""
    instructions, stage, pending = [], "", ""
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if "<<" in stripped and not pending:
            raise AssertionError(f"heredoc not supported by this lint: {line}")
        pending += " " + stripped.rstrip("\\").strip()
        if stripped.endswith("\\"):
            continue
        keyword, _, args = pending.strip().partition(" ")
        keyword, args, pending = keyword.upper(), args.strip(), ""
        if keyword == "FROM":
            parts = args.split()
            stage = parts[2] if len(parts) == 3 and parts[1].lower() == "as" else ""
        instructions.append((keyword, args, stage))
    return instructions


def key_values(args: str) -> dict[str, str]:
    """ENV / ARG `k=v k2="v 2"` (and the legacy `ENV k v`)."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.partition("=")[::2] for token in tokens)


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


def final_stage(instructions):
    last_from = max(i for i, (kw, _, _) in enumerate(instructions) if kw == "FROM")
    return instructions[last_from:]


def docker_env(instructions) -> dict[str, str]:
    env = {}
    for keyword, args, _ in final_stage(instructions):
        if keyword == "ENV":
            env.update(key_values(args))
    return env


def docker_args(instructions) -> dict[str, str]:
    values = {}
    for keyword, args, _ in instructions:
        if keyword == "ARG" and "=" in args:
            values.update(key_values(args))
    return values


def run_commands(instructions, stage=None) -> list[str]:
    return [args for keyword, args, name in instructions if keyword == "RUN" and (stage is None or name == stage)]


# ---- the wheel the image installs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def built_wheel(dockerfile, tmp_path_factory):
    """Run the Dockerfile's `pip wheel` on a tree made of exactly what its wheel stage COPYs."""
    stage = "wheel"
    copies = [args.split() for keyword, args, name in dockerfile if keyword == "COPY" and name == stage]
    assert copies, "the Dockerfile has no wheel stage with COPY instructions"
    root = tmp_path_factory.mktemp("image")
    for parts in copies:
        assert not parts[0].startswith("--"), f"unexpected COPY flags in the wheel stage: {parts}"
        *sources, dest = parts
        for source in sources:
            src = REPO / source.rstrip("/")
            target = root / dest.lstrip("/")
            if dest.endswith("/") and src.is_file():
                target = target / src.name
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
    (wheel_cmd,) = [cmd for cmd in run_commands(dockerfile, stage) if "pip wheel" in cmd]
    argv = shlex.split(wheel_cmd)
    assert argv[:4] == ["python", "-m", "pip", "wheel"], wheel_cmd
    argv = [sys.executable] + [str(root / arg.lstrip("/")) if arg.startswith("/") else arg for arg in argv[1:]]
    if _setuptools_ok():  # build with this environment's setuptools (offline); else pip's isolated build
        argv.insert(4, "--no-build-isolation")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheel_dir = Path(argv[argv.index("--wheel-dir") + 1])
    image_wheel_dir = shlex.split(wheel_cmd)[shlex.split(wheel_cmd).index("--wheel-dir") + 1]
    return {"dir": wheel_dir, "image_dir": image_wheel_dir, "files": sorted(wheel_dir.iterdir())}


def _setuptools_ok() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [name for name in zf.namelist() if name.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(metadata).decode()).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def ray_pin(built_wheel) -> str:
    """The exact Ray version the roseray wheel's `serve` extra requires (from pyproject)."""
    (wheel,) = built_wheel["files"]
    pins = [r for r in wheel_requirements(wheel) if re.match(r"ray\[serve\]==", r) and 'extra == "serve"' in r]
    assert len(pins) == 1, f"expected one exact ray[serve] pin in the serve extra, got {pins}"
    return re.match(r"ray\[serve\]==([\w.]+)", pins[0]).group(1)


def source_packages() -> set[str]:
    """Import packages of the source tree as wheel paths: roseray/..., roseray_kernels/..."""
    return {p.parent.relative_to(REPO).as_posix() for folder in ("roseray", "roseray_kernels")
            for p in (REPO / folder).rglob("__init__.py")}


def test_wheel_holds_every_package_of_the_source_tree(built_wheel):
    (wheel,) = built_wheel["files"]
    assert wheel.name.startswith("roseray-") and wheel.suffix == ".whl"
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {Path(name).parent.as_posix() for name in zf.namelist() if name.endswith("/__init__.py")}
    # pyproject lists its packages by hand: a subpackage missing there would be missing in the image
    expected = source_packages()
    assert {"roseray", "roseray_kernels"} <= expected
    assert expected <= in_wheel, f"packages missing from the wheel: {sorted(expected - in_wheel)}"


def test_image_installs_the_wheel_that_builds(dockerfile, built_wheel, ray_pin):
    runtime_runs = run_commands(final_stage(dockerfile))
    (install,) = [cmd for cmd in runtime_runs if "roseray-*.whl" in cmd]
    match = re.search(r"\$\(ls (\S+)\)\[\$\{EXTRAS\}\]", install)
    assert match, f"no `$(ls <wheel glob>)[${{EXTRAS}}]` install target in: {install}"
    glob = match.group(1)
    # the runtime stage copies the wheel stage's output to the directory it installs from
    copy_from = [args.split() for keyword, args, _ in final_stage(dockerfile)
                 if keyword == "COPY" and "--from=wheel" in args]
    assert copy_from and Path(glob).parent == Path(copy_from[0][-1].rstrip("/")), (glob, copy_from)
    assert Path(copy_from[0][-2]) == Path(built_wheel["image_dir"]), "COPY --from=wheel copies another directory"
    names = [p.name for p in built_wheel["files"]]
    assert len(fnmatch.filter(names, Path(glob).name)) == 1, (glob, names)
    (wheel,) = built_wheel["files"]
    extras = {m for r in wheel_requirements(wheel) for m in re.findall(r'extra == "([\w-]+)"', r)}
    default_extras = docker_args(final_stage(dockerfile))["EXTRAS"].split(",")
    assert "serve" in default_extras
    guide_extras = [e for found in re.findall(r"EXTRAS=([\w,]+)", GUIDE.read_text()) for e in found.split(",")]
    for extra in default_extras + guide_extras:
        assert extra in extras, f"the wheel has no [{extra}] extra"
    assert '"ray[serve]==${RAY_VERSION}"' in install and docker_args(dockerfile)["RAY_VERSION"] == ray_pin


def test_dockerfile_pins_match_the_project(dockerfile, ray_pin):
    args = docker_args(dockerfile)
    assert args["RAY_VERSION"] == ray_pin
    makefile_torch = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert args["TORCH_VERSION"] == makefile_torch, "the image's torch differs from the Makefile's pin"


def test_dockerfile_variants_cuda_runtime_and_cpu(dockerfile):
    args = docker_args(dockerfile)
    stages = {name for keyword, _, name in dockerfile if keyword == "FROM"}
    assert {f"base-{variant}" for variant in ("cuda", "cpu")} <= stages
    assert args["VARIANT"] == "cuda"
    assert "nvidia/cuda" in args["CUDA_IMAGE"] and "runtime" in args["CUDA_IMAGE"]
    cpu_env = [a for kw, a, name in dockerfile if kw == "ENV" and name == "base-cpu"]
    assert any("download.pytorch.org/whl/cpu" in a for a in cpu_env), "the cpu variant must install the CPU torch"
    assert any(kw == "FROM" and a.startswith("base-${VARIANT}") for kw, a, _ in dockerfile)


def test_dockerfile_installs_the_tools_things_call_at_run_time(dockerfile):
    (apt,) = [cmd for cmd in run_commands(dockerfile, "base") if "apt-get install" in cmd]
    packages = set(shlex.split(apt))
    # KubeRay's probes run wget; Triton compiles launcher stubs with gcc against Python.h
    assert {"wget", "gcc", "python3-dev", "python3-venv"} <= packages


def test_dockerfile_runs_as_a_numeric_non_root_user(dockerfile):
    users = [args for keyword, args, _ in final_stage(dockerfile) if keyword == "USER"]
    assert users and users[-1].isdigit() and int(users[-1]) != 0, "USER must be numeric (runAsNonRoot) and not 0"
    assert any(f"useradd --uid {users[-1]}" in cmd for cmd in run_commands(final_stage(dockerfile)))


def test_dockerfile_bakes_serve_config_and_exposes_its_port(dockerfile):
    config = render.load_yaml(SERVE_CONFIG)
    stage = final_stage(dockerfile)
    copies = [args.split() for keyword, args, _ in stage if keyword == "COPY" and "--from" not in args]
    assert ["serve_config.yaml", "/app/serve_config.yaml"] in copies
    exposed = [int(p.split("/")[0]) for keyword, args, _ in stage if keyword == "EXPOSE" for p in args.split()]
    assert exposed == [config["http_options"]["port"]]
    (cmd,) = [args for keyword, args, _ in stage if keyword == "CMD"]
    assert yaml.safe_load(cmd) == ["serve", "run", "/app/serve_config.yaml"]
    # `docker stop` must drain: serve run stops gracefully on SIGINT, and exits at once on SIGTERM
    assert [args for keyword, args, _ in stage if keyword == "STOPSIGNAL"] == ["SIGINT"]
    for keyword, args, _ in dockerfile:  # every plain COPY source is in the build context
        if keyword == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY source {source} does not exist"


def test_dockerignore_keeps_the_venv_out_and_every_copy_source_in(dockerfile):
    patterns = [line.strip() for line in (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    for keyword, args, _ in dockerfile:
        if keyword == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                parts = Path(source.rstrip("/")).parts
                prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
                hits = [p for p in patterns if any(fnmatch.fnmatch(prefix, p) for prefix in prefixes)]
                assert not hits, f"COPY {source} is excluded from the build context by {hits}"


def image_haproxy_dir(env: dict) -> str:
    return str(Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"]).parent)


def serving_env(state_dir: str, tmp_path: Path, flags: list[str]) -> dict[str, str]:
    """What `python -m roseray.ray_serve.haproxy_env --dir <state_dir> <flags>` exports on a GPU node
    (run for real in a temporary directory, then named with `state_dir`; the image is for GPU
    nodes: CUDA_VISIBLE_DEVICES=0 makes this machine count as one)."""
    tmp_dir = tmp_path / "haproxy"
    out = subprocess.run([sys.executable, "-m", "roseray.ray_serve.haproxy_env", "--dir", str(tmp_dir), *flags],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    env = {}
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0].replace(str(tmp_dir), state_dir)
    assert (tmp_dir / "haproxy").is_file()
    return env


def test_image_env_is_the_serving_env(dockerfile, tmp_path):
    env = docker_env(dockerfile)
    ray_env = {k: v for k, v in env.items() if k.startswith("RAY_")}
    state_dir = image_haproxy_dir(env)
    # the RUN that writes the HAProxy wrapper uses that directory, as the runtime user
    stage = final_stage(dockerfile)
    (idx,) = [i for i, (kw, a, _) in enumerate(stage) if kw == "RUN" and "roseray.ray_serve.haproxy_env" in a]
    command = shlex.split(stage[idx][1])
    assert command[:5] == ["python", "-m", "roseray.ray_serve.haproxy_env", "--dir", state_dir]
    flags = command[5:command.index(">")]
    expected = serving_env(state_dir, tmp_path, flags)
    assert {k: ray_env[k] for k in ray_env if k not in PORT_RANGE_VARS} == expected
    low, high = (int(ray_env[k]) for k in PORT_RANGE_VARS)
    assert low < high
    assert any(kw == "USER" for kw, _, _ in stage[:idx]), "write the wrapper as the runtime user (mode 700 dir)"
    assert len(state_dir) < 60, "HAProxy's unix socket paths must stay short"


# ---- the KubeRay manifest -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifest_text():
    return MANIFEST.read_text()


@pytest.fixture(scope="module")
def docs(manifest_text):
    return render.load_manifest(manifest_text)


@pytest.fixture(scope="module")
def rayservice(docs):
    return render.find_rayservice(docs)


def pod_templates(rayservice) -> dict[str, dict]:
    spec = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({f"worker:{g['groupName']}": g["template"] for g in spec["workerGroupSpecs"]})
    return templates


def ray_container(template) -> dict:
    (container,) = [c for c in template["spec"]["containers"] if c["name"].startswith("ray-")]
    return container


def container_env(template) -> dict[str, str]:
    return {item["name"]: item["value"] for item in ray_container(template).get("env", []) if "value" in item}


def test_manifest_parses_into_the_expected_objects(docs):
    assert sorted(doc["kind"] for doc in docs) == ["NetworkPolicy", "RayService"]
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"]


def test_manifest_serve_config_is_rendered_from_serve_config(manifest_text):
    rendered = render.render_manifest(manifest_text, render.load_yaml(SERVE_CONFIG))
    assert rendered == manifest_text, "run: python deploy/render_rayservice.py"


def check_serve_config(config: dict) -> None:
    """Ray Serve's schema, plus what it lets through silently: Serve ignores unknown keys, so
    every key must be a field of its model, and roseray's args must satisfy AppArgs (extra
    keys forbidden) and EngineConfig. Deployment overrides must name one of roseray's."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        LoggingConfig,
        RayActorOptionsSchema,
        ServeApplicationSchema,
    )

    from roseray.config import EngineConfig
    from roseray.ray_serve.app import AppArgs, EngineDeployment, RouterDeployment

    def known(section: dict | None, model, where: str) -> None:
        unknown = set(section or {}) - set(model.model_fields)
        assert not unknown, f"{where}: keys {sorted(unknown)} are not {model.__name__} fields (Serve would ignore them)"

    ServeDeploySchema.model_validate(config)
    known(config, ServeDeploySchema, "top level")
    known(config.get("http_options"), HTTPOptionsSchema, "http_options")
    known(config.get("logging_config"), LoggingConfig, "logging_config")
    for app in config["applications"]:
        known(app, ServeApplicationSchema, f"application {app.get('name')}")
        if app["import_path"] == render.ROSERAY_IMPORT_PATH:
            EngineConfig(**AppArgs(**app.get("args", {})).engine)
        for deployment in app.get("deployments", []):
            assert deployment["name"] in {EngineDeployment.name, RouterDeployment.name}, deployment["name"]
            known(deployment, DeploymentSchema, f"deployment {deployment['name']}")
            known(deployment.get("ray_actor_options"), RayActorOptionsSchema, "ray_actor_options")
            if deployment.get("autoscaling_config"):
                known(deployment["autoscaling_config"], AutoscalingConfig, "autoscaling_config")
                AutoscalingConfig(**deployment["autoscaling_config"])


def test_embedded_serve_config_validates(rayservice):
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    check_serve_config(config)
    assert config["http_options"]["host"] == "0.0.0.0"


def test_serve_config_yaml_validates():
    check_serve_config(render.load_yaml(SERVE_CONFIG))


def _diff(a, b, path=()):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a.keys() | b.keys():
            yield from _diff(a.get(key, _MISSING), b.get(key, _MISSING), path + (key,))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diff(x, y, path + (i,))
    elif a != b:
        yield path


_MISSING = object()


def test_cluster_config_differs_from_serve_config_only_where_documented(rayservice):
    local = render.load_yaml(SERVE_CONFIG)
    cluster = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (i,) = [n for n, app in enumerate(local["applications"]) if app["import_path"] == "roseray.ray_serve.app:build_app"]
    args = ("applications", i, "args")
    expected = {("http_options", "host"), args + ("num_gpus_per_replica",), args + ("num_replicas",),
                args + ("drain_timeout_s",)}
    if "num_kv_blocks" in local["applications"][i]["args"].get("engine", {}):
        expected.add(args + ("engine", "num_kv_blocks"))
    assert set(_diff(local, cluster)) == expected
    cluster_args = cluster["applications"][i]["args"]
    gpus = sum(g["replicas"] * ray_container(g["template"])["resources"]["limits"]["nvidia.com/gpu"]
               for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    assert cluster_args["num_replicas"] == gpus and cluster_args["num_gpus_per_replica"] == 1
    assert "num_kv_blocks" not in cluster_args["engine"]


def _with_args(**args) -> dict:
    config = render.load_yaml(SERVE_CONFIG)
    (app,) = [a for a in config["applications"] if a["import_path"] == render.ROSERAY_IMPORT_PATH]
    app["args"].update(args)
    return config


def _cluster_args(config: dict, gpus: int | str) -> dict:
    (app,) = [a for a in render.cluster_serve_config(config, gpus)["applications"]
              if a["import_path"] == render.ROSERAY_IMPORT_PATH]
    return app["args"]


def test_cluster_config_of_tensor_parallel_and_autoscaled_apps(manifest_text, rayservice):
    tp2 = _with_args(engine={"model": "random:gpt2", "tensor_parallel_size": 2})
    assert {k: _cluster_args(tp2, 8)[k] for k in ("num_gpus_per_replica", "num_replicas")} == {
        "num_gpus_per_replica": 2, "num_replicas": 4}
    with pytest.raises(ValueError, match="not a multiple of tensor_parallel_size 2"):
        _cluster_args(tp2, 7)
    per_pod = {render.pod_gpus(g["template"]) for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    if per_pod == {1}:  # the manifest's one-GPU pods cannot hold a two-rank replica
        with pytest.raises(ValueError, match="a replica's ranks must share a pod"):
            render.render_manifest(manifest_text, tp2)
    autoscaled = _with_args(autoscaling={"min_replicas": 1, "max_replicas": 3})
    assert _cluster_args(autoscaled, 4)["num_replicas"] == "auto"  # min_replicas to start
    with pytest.raises(ValueError, match="max_replicas x 1 GPUs = 3 exceeds the worker groups' 2 GPUs"):
        _cluster_args(autoscaled, 2)


def test_rayservice_cluster_shape(rayservice, ray_pin):
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not cluster.get("headServiceAnnotations")
    assert not cluster.get("enableIngress") and not head.get("enableIngress"), "the dashboard must stay private"
    assert head["rayStartParams"]["num-gpus"] == "0"
    for container in head["template"]["spec"]["containers"]:
        resources = container.get("resources") or {}
        assert all("nvidia.com/gpu" not in (resources.get(k) or {}) for k in ("requests", "limits"))
    images = {c["image"] for t in pod_templates(rayservice).values() for c in t["spec"]["containers"]}
    assert len(images) == 1, f"every Ray node runs the same image: {images}"
    for group in cluster["workerGroupSpecs"]:
        resources = ray_container(group["template"])["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
        assert resources["requests"].get("nvidia.com/gpu") == resources["limits"]["nvidia.com/gpu"]
        tolerations = group["template"]["spec"].get("tolerations") or []
        assert any(t.get("key") == "nvidia.com/gpu" for t in tolerations)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for template in pod_templates(rayservice).values():
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_clusters_keep_rays_draining_period_and_one_machine_does_not_wait(rayservice, dockerfile, tmp_path):
    """A stopping replica stays reachable for Ray's 30 s on a cluster (a load balancer in front
    of the nodes deregisters it first); `make serve` on one machine exports haproxy_env's
    default, which lets an idle stop finish at once (tests/ray_serve/test_serve_lifecycle.py)."""
    name = haproxy_env.MIN_DRAINING_PERIOD_ENV
    cluster = f"{haproxy_env.CLUSTER_MIN_DRAINING_PERIOD_S:g}"
    assert cluster == "30"  # Ray's default
    assert docker_env(dockerfile)[name] == cluster
    assert {container_env(t)[name] for t in pod_templates(rayservice).values()} == {cluster}
    assert f"--min-draining-period-s {cluster}" in GUIDE.read_text(), "bare metal: the guide's haproxy_env"
    local = haproxy_env.haproxy_env(str(tmp_path / "hap"))[name]
    assert float(local) == haproxy_env.LOCAL_MIN_DRAINING_PERIOD_S <= 1


def test_every_node_starts_ray_with_the_image_serving_env(rayservice, dockerfile):
    image_env = {k: v for k, v in docker_env(dockerfile).items() if k.startswith("RAY_")}
    node_envs = {name: container_env(t) for name, t in pod_templates(rayservice).items()}
    assert len({tuple(sorted(env.items())) for env in node_envs.values()}) == 1, "nodes disagree on Ray env"
    env = next(iter(node_envs.values()))
    ray_env = {k: v for k, v in env.items() if k.startswith("RAY_")}
    assert {k: ray_env.get(k) for k in image_env} == image_env
    assert set(ray_env) - set(image_env) == MANIFEST_EXTRA_ENV


def test_long_streams_can_finish(rayservice):
    spec = rayservice["spec"]
    env = container_env(pod_templates(rayservice)["head"])
    config = yaml.safe_load(spec["serveConfigV2"])
    budget = render.MAX_STREAM_S
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterDeletionDelaySeconds"] >= budget, "the old cluster must outlive its streams"
    assert int(env["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"]) >= budget, "a HAProxy reload would cut streams"
    default_timeout_client = serve_constants.RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S
    timeout_client = int(env.get("RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S", default_timeout_client))
    assert timeout_client >= budget
    assert all(app["args"]["drain_timeout_s"] >= budget for app in config["applications"])
    assert env["RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"] == "1"


def _rule_ports(rule) -> list[tuple[int, int]] | None:
    if "ports" not in rule:
        return None  # every port
    return [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]


def _only_own_pods(rule) -> bool:
    peers = rule.get("from")
    return bool(peers) and all(set(p) == {"podSelector"} and p["podSelector"].get("matchLabels") == APP_LABEL
                               for p in peers)


def test_network_policy_keeps_internal_ports_internal(docs, rayservice):
    (policy,) = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == APP_LABEL and spec["policyTypes"] == ["Ingress"]
    for name, template in pod_templates(rayservice).items():
        labels = template.get("metadata", {}).get("labels", {})
        assert APP_LABEL.items() <= labels.items(), f"the {name} pods escape the NetworkPolicy"
    env = container_env(pod_templates(rayservice)["head"])
    low, high = (int(env[k]) for k in PORT_RANGE_VARS)
    serve_port = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"]
    internal = [(low, high)] + [(p, p) for p in (*HAPROXY_SIDE_PORTS, RAY_CLIENT_PORT, GCS_PORT)]
    rules = spec["ingress"]
    # between nodes: the cluster's own pods reach every port, the direct-ingress range included
    assert any(_only_own_pods(r) and _rule_ports(r) is None for r in rules)
    # clients: the Serve port
    assert any("from" not in r and _rule_ports(r) == [(serve_port, serve_port)] for r in rules)
    for rule in rules:
        if _only_own_pods(rule):
            continue
        ports = _rule_ports(rule)
        assert ports is not None, f"a rule open to others must name its ports: {rule}"
        for a, b in ports:
            for lo, hi in internal:
                assert b < lo or a > hi, f"{rule} opens internal ports {lo}-{hi} beyond the cluster"
        if "from" not in rule:  # open to everyone
            assert ports == [(serve_port, serve_port)], f"only the Serve port may be public: {rule}"
        elif (DASHBOARD_PORT, DASHBOARD_PORT) in ports:
            assert all("podSelector" in peer for peer in rule["from"]), "the dashboard is for the operator only"


def test_direct_ingress_range_fits_between_ray_and_the_kernel(rayservice):
    from ray.scripts.scripts import start

    env = container_env(pod_templates(rayservice)["head"])
    low, high = (int(env[k]) for k in PORT_RANGE_VARS)
    defaults = {p.name: p.default for p in start.params}
    params = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    worker_low = int(params.get("min-worker-port", defaults["min_worker_port"]))
    worker_high = int(params.get("max-worker-port", defaults["max_worker_port"]))
    assert high < worker_low or low > worker_high, "direct-ingress ports overlap Ray's worker ports"
    assert high < 32768, "Linux hands out ephemeral ports from 32768: the range must stay below"


# ---- the render script --------------------------------------------------------------------------

def test_render_check_fails_when_serve_config_changes(tmp_path):
    config = render.load_yaml(SERVE_CONFIG)
    config["applications"][0]["args"]["engine"]["max_num_seqs"] = 7
    changed = tmp_path / "serve_config.yaml"
    changed.write_text(yaml.safe_dump(config))
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text(MANIFEST.read_text())
    assert render.main(["--serve-config", str(SERVE_CONFIG), "--manifest", str(manifest)]) == 0
    written = manifest.read_text()
    assert render.main(["--check", "--serve-config", str(SERVE_CONFIG), "--manifest", str(manifest)]) == 0
    assert render.main(["--check", "--serve-config", str(changed), "--manifest", str(manifest)]) == 1
    assert render.main(["--serve-config", str(changed), "--manifest", str(manifest)]) == 0
    rendered = render.find_rayservice(render.load_manifest(manifest.read_text()))
    assert yaml.safe_load(rendered["spec"]["serveConfigV2"])["applications"][0]["args"]["engine"]["max_num_seqs"] == 7
    # everything outside serveConfigV2 is left as written, comments included
    strip = re.compile(r"  serveConfigV2: \|\n(    .*\n|\n)*")
    assert strip.sub("", manifest.read_text()) == strip.sub("", written) == strip.sub("", MANIFEST.read_text())


# ---- the guide ----------------------------------------------------------------------------------

def test_guide_yaml_snippets_are_valid_serve_configs():
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)
    configs = [yaml.safe_load(b) for b in blocks if "applications:" in b]
    assert len(configs) >= 2, "the guide shows the placement and autoscaling configs"
    for config in configs:
        check_serve_config(config)


def test_guide_sets_the_manifest_ray_env_at_ray_start(rayservice):
    guide = GUIDE.read_text()
    env = container_env(pod_templates(rayservice)["head"])
    assert "python -m roseray.ray_serve.haproxy_env" in guide
    for name in (*PORT_RANGE_VARS, *MANIFEST_EXTRA_ENV):
        assert re.search(rf"export {name}={re.escape(env[name])}\b", guide), f"the guide does not export {name}"
    assert "ray start --head" in guide and "RAY_AUTH_MODE=token" in guide
