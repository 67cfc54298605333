"""serve_config.yaml -> the RayService's serveConfigV2: one source of truth for the Serve app.

    python deploy/render_rayservice.py            # rewrite serveConfigV2 in deploy/kuberay/rayservice.yaml
    python deploy/render_rayservice.py --check    # exit 1 when the manifest is out of date
    python deploy/render_rayservice.py --print-cluster-config [--num-replicas auto]
                                                  # the same cluster config for a bare-metal `serve deploy`

The cluster config is serve_config.yaml with these changes and no others (tests/ray_serve/test_deploy.py
checks the manifest against this list):

  http_options.host            0.0.0.0: HAProxy on one node must reach engine replicas on the
                               others; the NetworkPolicy (or a firewall) closes their ports to clients
  <app>.args.num_gpus_per_replica  engine.tensor_parallel_size (1 by default): "auto" counts the GPUs
                               Ray sees when the app is deployed, which may be before the GPU workers
                               have joined; a replica's ranks share one pod, so each pod's GPUs must
                               be a multiple of it
  <app>.args.num_replicas      the GPUs of the manifest's worker groups (replicas x nvidia.com/gpu)
                               divided by the GPUs per replica; with `autoscaling`, "auto" (its
                               min_replicas), and max_replicas must fit those GPUs;
                               bare metal: a number or "auto" once every worker has joined
  <app>.args.engine.num_kv_blocks  removed: on GPU the KV cache is sized from gpu_memory_utilization
  <app>.args.drain_timeout_s   MAX_STREAM_S: a replaced or scaled-down engine replica finishes its
                               running streams for this long (Ray Serve waits drain_timeout_s plus a
                               margin for the replica's processes: build_app's graceful_shutdown_timeout_s)

where <app> is every application whose import_path is roseray's (roseray.ray_serve.app:build_app).
Only the cluster parts of the manifest are written by hand; this script rewrites the
`serveConfigV2: |` block and leaves every other line as it is.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
SERVE_CONFIG = REPO / "serve_config.yaml"
MANIFEST = REPO / "deploy" / "kuberay" / "rayservice.yaml"

ROSERAY_IMPORT_PATH = "roseray.ray_serve.app:build_app"
CLUSTER_HOST = "0.0.0.0"
MAX_STREAM_S = 600  # the longest stream a rolling update, scale-down or cluster upgrade lets finish
GPU_RESOURCE = "nvidia.com/gpu"
_BLOCK_KEY = "serveConfigV2"


def load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def load_manifest(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find_rayservice(docs: list[dict]) -> dict:
    found = [doc for doc in docs if doc.get("kind") == "RayService"]
    if len(found) != 1:
        raise ValueError(f"expected one RayService in the manifest, found {len(found)}")
    return found[0]


def pod_gpus(template: dict) -> int:
    """nvidia.com/gpu limit of a pod template's containers (0 when none asks for a GPU)."""
    total = 0
    for container in template["spec"]["containers"]:
        limits = (container.get("resources") or {}).get("limits") or {}
        total += int(limits.get(GPU_RESOURCE, 0))
    return total


def check_pods_fit_replicas(rayservice: dict, serve_config: dict) -> None:
    """A tensor-parallel replica's ranks run in one pod: every GPU pod must hold whole replicas."""
    for app in serve_config.get("applications") or []:
        gpus = int(((app.get("args") or {}).get("engine") or {}).get("tensor_parallel_size", 1))
        for group in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []:
            pod = pod_gpus(group["template"])
            if pod and pod % gpus:
                raise ValueError(f"worker group {group.get('groupName')!r} has {pod} GPU(s) per pod, not a multiple "
                                 f"of tensor_parallel_size {gpus}: a replica's ranks must share a pod")


def worker_gpus(rayservice: dict) -> int:
    """GPUs of the worker groups at their `replicas` count: one engine replica per GPU."""
    groups = rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
    return sum(int(group.get("replicas", 0)) * pod_gpus(group["template"]) for group in groups)


def cluster_serve_config(serve_config: dict, num_replicas: int | str) -> dict:
    """serve_config.yaml with the cluster changes listed in the module docstring."""
    config = copy.deepcopy(serve_config)
    config.setdefault("http_options", {})["host"] = CLUSTER_HOST
    apps = [app for app in config.get("applications") or [] if app.get("import_path") == ROSERAY_IMPORT_PATH]
    if not apps:
        raise ValueError(f"serve config has no application with import_path {ROSERAY_IMPORT_PATH}")
    for app in apps:
        args = app.setdefault("args", {})
        gpus = int(args.get("engine", {}).get("tensor_parallel_size", 1))
        args["num_gpus_per_replica"] = gpus
        args["num_replicas"] = app_replicas(args, num_replicas, gpus)
        args["drain_timeout_s"] = MAX_STREAM_S
        args.setdefault("engine", {}).pop("num_kv_blocks", None)
    return config


def app_replicas(args: dict, gpus_total: int | str, gpus_per_replica: int) -> int | str:
    """An app's num_replicas on a cluster of `gpus_total` GPUs ("auto": not known yet)."""
    autoscaling = args.get("autoscaling")
    if gpus_total == "auto":
        return "auto"
    if autoscaling:
        most = int(autoscaling.get("max_replicas", 1)) * gpus_per_replica
        if most > gpus_total:
            raise ValueError(f"autoscaling.max_replicas x {gpus_per_replica} GPUs = {most} exceeds the worker groups' "
                             f"{gpus_total} GPUs")
        return "auto"
    if gpus_total % gpus_per_replica:
        raise ValueError(f"the worker groups' {gpus_total} GPUs are not a multiple of tensor_parallel_size "
                         f"{gpus_per_replica}")
    return gpus_total // gpus_per_replica


def dump_serve_config(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=100)


def replace_block(text: str, key: str, body: str) -> str:
    """Replace the literal block scalar `key: |` in `text` with `body`, keeping every other line."""
    lines = text.split("\n")
    pattern = re.compile(rf"^(\s*){re.escape(key)}: \|\s*$")
    starts = [i for i, line in enumerate(lines) if pattern.match(line)]
    if len(starts) != 1:
        raise ValueError(f"expected one `{key}: |` line in the manifest, found {len(starts)}")
    start = starts[0]
    indent = len(pattern.match(lines[start]).group(1))
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():  # blank lines after the block stay outside it
        end -= 1
    pad = " " * (indent + 2)
    block = [pad + line if line else "" for line in body.rstrip("\n").split("\n")]
    return "\n".join(lines[:start + 1] + block + lines[end:])


def render_manifest(manifest_text: str, serve_config: dict) -> str:
    rayservice = find_rayservice(load_manifest(manifest_text))
    num_replicas = worker_gpus(rayservice)
    if num_replicas < 1:
        raise ValueError("the RayService's worker groups ask for no GPU (resources.limits['nvidia.com/gpu'])")
    check_pods_fit_replicas(rayservice, serve_config)
    return replace_block(manifest_text, _BLOCK_KEY, dump_serve_config(cluster_serve_config(serve_config, num_replicas)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve-config", type=Path, default=SERVE_CONFIG)
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--check", action="store_true", help="exit 1 if the manifest is not what this renders")
    parser.add_argument("--print-cluster-config", action="store_true",
                        help="print the cluster serve config (bare metal) instead of touching the manifest")
    parser.add_argument("--num-replicas", default="auto",
                        help="with --print-cluster-config: engine replicas, a number or auto (default)")
    args = parser.parse_args(argv)
    serve_config = load_yaml(args.serve_config)
    if args.print_cluster_config:
        num_replicas = args.num_replicas if args.num_replicas == "auto" else int(args.num_replicas)
        sys.stdout.write(dump_serve_config(cluster_serve_config(serve_config, num_replicas)))
        return 0
    current = args.manifest.read_text()
    rendered = render_manifest(current, serve_config)
    if args.check:
        if rendered != current:
            print(f"{args.manifest} is out of date with {args.serve_config}: run python deploy/render_rayservice.py",
                  file=sys.stderr)
            return 1
        return 0
    if rendered != current:
        args.manifest.write_text(rendered)
        print(f"wrote {args.manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
