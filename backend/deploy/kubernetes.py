"""Kubernetes manifests from a topology: a kustomize base (``kubectl apply -k DIR``), plain YAML.

    python -m backend.deploy.kubernetes topologies/hosts-e-pd.yaml --out /tmp/k8s --image REGISTRY/triton-epd:TAG
    kubectl apply -k /tmp/k8s

The stages run in tiers, each a Deployment of identical pods, one tritonserver per pod. With a ``hosts:`` block
(``backend.deploy.hosts``) the hosts that carry the same stages form a tier, its replicas their count (the hosts'
addresses, ports and interfaces are the pods': their own IP, 8000/8001/8002, eth0). Without one, each stage is a
tier of one replica (``epd``: the proxy orchestrators; a colocated orchestrator is in its host stage's tier), so every
stage scales on its own, the encoders too (the orchestrators reach them over gRPC). A tier is named after its stages
(``pd``, ``encoder-epd``) and has:
- a ConfigMap of its model repository (the rendered files, the checkpoint at ``CHECKPOINT``), copied by an init
  container into an emptyDir at ``REPOSITORY``: mounted as it is, the ConfigMap volume's own ``..data`` entries
  would sit among the models;
- a Deployment: tritonserver on all addresses, readiness and liveness probes on Triton's ``/v2/health/ready`` and
  ``/v2/health/live`` (a startup probe allows a long model load), ``nvidia.com/gpu`` for its GPU stages (the
  stages' GPU ids renumbered from 0 within the pod), ``UCX_NET_DEVICES=eth0``, ``VLLM_NIXL_SIDE_CHANNEL_HOST`` the pod
  IP and ``EPD_HOST`` the pod name (downward API), the checkpoint from a PersistentVolumeClaim, /dev/shm in memory;
- a headless Service, so its DNS name resolves to every ready pod: the orchestrators' endpoint parameters are those
  names (``<tier>.<namespace>.svc.cluster.local:8001``) and the runtime routes across the addresses;
- a HorizontalPodAutoscaler (autoscaling/v2) on the project's own metrics per pod (``SCALE_ON``), which the cluster
  gets from Prometheus through a metrics adapter (docs/operations.md, "Kubernetes").
The namespace and the endpoints' DNS names are rendered in: change them with ``--namespace`` and render again, not with
a kustomize overlay (an overlay's ``namespace`` or ``namePrefix`` would leave the endpoints pointing elsewhere).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from backend.deploy.hosts import DEVICES_ENV, HOST_ENV, PORT_DEFAULTS, SIDE_CHANNEL_ENV, launch_argv, models_at, \
    with_endpoints
from backend.deploy.render import render_files
from backend.deploy.schema import ENGINE_STAGES, Topology, TopologyError
from backend.deploy.topology import load
from backend.protocol.stages import Stage

REPOSITORY = "/repository"
CHECKPOINT = "/checkpoint"
CONFIG = "/config"  # the ConfigMap's mount in the init container
PORTS = {name.removesuffix("_port"): port for name, port in PORT_DEFAULTS.items()}  # http, grpc, metrics
KUBERNETES_VERSION = "1.37"  # the API the manifests are validated against (kubernetes-validate's schemas)
STAGE_ORDER = tuple(stage.value for stage in Stage)
# stage -> (a metric per pod, its target): engines on their KV cache's use (epd_vllm_kv_cache_usage, a fraction), the
# encoders on their embedding pool's bytes held (epd_pool_used_bytes; the target: half of transfer.pool_bytes), the
# proxy orchestrators on their finished requests per second (the rate of epd_requests_total; one did 66-80 req/s
# on 2 cores, docs/results/epd.md). Per pod the adapter averages the pod's instances (docs/operations.md).
SCALE_ON = {**{stage: ("epd_vllm_kv_cache_usage", "700m") for stage in ENGINE_STAGES},
            Stage.ENCODER.value: ("epd_pool_used_bytes", None), Stage.ORCHESTRATOR.value: ("epd_requests_per_second", "50")}
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_CONFIG_MAP_LIMIT = 1 << 20  # a ConfigMap holds at most 1 MiB


@dataclass(frozen=True)
class Tier:
    """Pods alike: the stages they serve and how many there are to start with."""

    name: str
    stages: tuple[str, ...]
    replicas: int = 1


@dataclass(frozen=True)
class Options:
    """What the cluster decides and the topology does not (the CLI's flags)."""

    namespace: str = "epd"
    image: str = "triton-epd:latest"  # the project with its venv (make setup), `tritonserver` (the venv's) on PATH
    checkpoint_claim: str = "epd-checkpoint"  # a PersistentVolumeClaim holding the checkpoint (not rendered here)
    prefix: str = ""  # before every tier's name (two topologies in one namespace)
    max_replicas: int = 8  # each autoscaler's ceiling (at least the tier's replicas)
    tritonserver: str = "tritonserver"
    shm: str = "1Gi"  # /dev/shm of each pod (the Python backend's stubs talk to tritonserver through it)
    targets: tuple[tuple[str, str], ...] = ()  # (stage, target) over SCALE_ON's (clients.plan: derived from a profile)


def tiers(topology: Topology, prefix: str = "") -> dict[str, Tier]:
    """The topology's tiers by name: the hosts with the same stages, or one per stage without a hosts block."""
    groups: dict[tuple[str, ...], int] = {}
    if topology.hosts:
        for host in topology.hosts.values():
            held = tuple(stage for stage in STAGE_ORDER if stage in host.stages)
            groups[held] = groups.get(held, 0) + 1
    else:  # decode's engine in E/P/D's orchestrator (decode_in_process): in prefill's pods, one tier
        together = ("prefill", "decode") if topology.decode_in_process else ()
        groups = {((stage,) if stage not in together else together): 1
                  for stage in STAGE_ORDER if stage in topology.stages}
    out = {}
    for held, replicas in groups.items():
        name = prefix + "-".join(held)
        if not _DNS_1035.match(name):
            raise TopologyError(f"tier {name!r}: not a Kubernetes Service name (DNS-1035 label, at most 63; "
                                f"check --prefix)")
        out[name] = Tier(name, held, replicas)
    return out


def manifests(topology: Topology, options: Options = Options()) -> dict[str, list[dict[str, Any]]]:
    """File name -> its documents: ``namespace.yaml``, one ``<tier>.yaml`` per tier (ConfigMap, Deployment, Service,
    HorizontalPodAutoscaler), and ``kustomization.yaml`` listing them."""
    if not _DNS_1035.match(options.namespace):
        raise TopologyError(f"--namespace {options.namespace!r}: not a namespace name (DNS-1035 label)")
    tiered = tiers(topology, options.prefix)
    places = {t.name: (t.stages, f"{t.name}.{options.namespace}.svc.cluster.local:{PORTS['grpc']}")
              for t in tiered.values()}
    files: dict[str, list[dict[str, Any]]] = {"namespace.yaml": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace}}]}
    for tier in tiered.values():
        view = with_endpoints(_in_pod(topology, tier), places, tier.name)
        repository = render_files(view, Path(REPOSITORY), models_at(view, tier.stages))
        labels = _labels(topology, tier)
        files[f"{tier.name}.yaml"] = [_config_map(tier, labels, repository, options),
                                      _deployment(view, tier, labels, repository, options),
                                      _service(tier, labels, options), _autoscaler(view, tier, labels, options)]
    files["kustomization.yaml"] = [{"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                    "resources": list(files)}]
    return files


def _in_pod(topology: Topology, tier: Tier) -> Topology:
    """The topology as one of ``tier``'s pods renders it: the checkpoint at ``CHECKPOINT``, its stages' GPU ids
    renumbered from 0 (a pod sees only the GPUs it was given)."""
    ids = sorted({gpu for stage in tier.stages for gpu in topology.stages[stage].gpus})
    stages = {stage: replace(spec, gpus=tuple(ids.index(g) for g in spec.gpus)) if stage in tier.stages else spec
              for stage, spec in topology.stages.items()}
    return replace(topology, checkpoint=Path(CHECKPOINT), stages=stages)


def _labels(topology: Topology, tier: Tier) -> dict[str, str]:
    instance = re.sub(r"[^A-Za-z0-9._-]", "-", topology.name)[:63].strip("-._") or "epd"
    return {"app.kubernetes.io/name": "triton-epd", "app.kubernetes.io/instance": instance,
            "app.kubernetes.io/component": tier.name}


def _meta(name: str, labels: dict[str, str], options: Options) -> dict[str, Any]:
    return {"name": name, "namespace": options.namespace, "labels": dict(labels)}


def _key(path: str) -> str:
    """A ConfigMap key for a repository file (keys have no '/'); the volume's items put it back at its path."""
    return path.replace("/", "__")


def _config_map(tier: Tier, labels: dict[str, str], repository: dict[str, str], options: Options) -> dict[str, Any]:
    size = sum(len(text.encode()) for text in repository.values())
    if size > _CONFIG_MAP_LIMIT:
        raise TopologyError(f"tier {tier.name}: its model repository is {size} bytes, over a ConfigMap's 1 MiB")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{tier.name}-repository", labels, options),
            "data": {_key(path): text for path, text in sorted(repository.items())}}


def _deployment(topology: Topology, tier: Tier, labels: dict[str, str], repository: dict[str, str],
                options: Options) -> dict[str, Any]:
    digest = hashlib.sha256(yaml.safe_dump(repository, sort_keys=True).encode()).hexdigest()[:16]
    probe = {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10}
    container = {
        "name": "tritonserver", "image": options.image,
        "command": list(launch_argv(options.tritonserver, REPOSITORY, "0.0.0.0", PORT_DEFAULTS)),
        "env": [{"name": DEVICES_ENV, "value": "eth0"},
                {"name": SIDE_CHANNEL_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in PORTS.items()],
        "startupProbe": {**probe, "failureThreshold": 90},  # up to 15 minutes to load the models
        "livenessProbe": {**probe, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "volumeMounts": [{"name": "repository", "mountPath": REPOSITORY},
                         {"name": "checkpoint", "mountPath": CHECKPOINT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}]}
    gpus = len({gpu for stage in tier.stages for gpu in topology.stages[stage].gpus})
    if gpus:
        container["resources"] = {"requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}
    init = {"name": "repository", "image": options.image, "command": ["sh", "-c", f"cp -rL {CONFIG}/* {REPOSITORY}/"],
            "volumeMounts": [{"name": "config", "mountPath": CONFIG, "readOnly": True},
                             {"name": "repository", "mountPath": REPOSITORY}]}
    volumes = [{"name": "config", "configMap": {"name": f"{tier.name}-repository",
                                                "items": [{"key": _key(p), "path": p} for p in sorted(repository)]}},
               {"name": "repository", "emptyDir": {}},
               {"name": "checkpoint", "persistentVolumeClaim": {"claimName": options.checkpoint_claim, "readOnly": True}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm}}]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"]),
                   "prometheus.io/path": "/metrics", "triton-epd/repository-sha256": digest}  # a new rendering rolls
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(tier.name, labels, options),
            "spec": {"replicas": tier.replicas, "selector": {"matchLabels": dict(labels)},
                     "template": {"metadata": {"labels": dict(labels), "annotations": annotations},
                                  "spec": {"initContainers": [init], "containers": [container], "volumes": volumes,
                                           "terminationGracePeriodSeconds": 60}}}}


def _service(tier: Tier, labels: dict[str, str], options: Options) -> dict[str, Any]:
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in PORTS.items()]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(tier.name, labels, options),
            "spec": {"clusterIP": "None", "selector": dict(labels), "ports": ports}}


def _autoscaler(topology: Topology, tier: Tier, labels: dict[str, str], options: Options) -> dict[str, Any]:
    metrics = []
    for stage in tier.stages:
        name, target = SCALE_ON[stage]
        target = dict(options.targets).get(stage) or target or str(topology.transfer["pool_bytes"] // 2)
        metrics.append({"type": "Pods", "pods": {"metric": {"name": name},
                                                 "target": {"type": "AverageValue", "averageValue": target}}})
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(tier.name, labels, options),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": tier.name},
                     "minReplicas": tier.replicas, "maxReplicas": max(tier.replicas, options.max_replicas),
                     "metrics": [m for i, m in enumerate(metrics) if m not in metrics[:i]]}}


def validate(files: dict[str, list[dict[str, Any]]], version: str = KUBERNETES_VERSION) -> list[str]:
    """Each Kubernetes object checked against the API's schemas, offline (``kubernetes-validate``'s bundled schemas,
    strict: an unknown field is an error too): the first problem of each object, ``file: kind/name: path: message``;
    [] when none."""
    import kubernetes_validate

    problems = []
    for file, documents in files.items():
        for doc in documents:
            if doc.get("kind") == "Kustomization":  # kustomize's own file, not an API object
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(part) for part in exc.path)
                problems.append(f"{file}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{file}: {exc.message}")
    return problems


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people to read: no anchors for repeated values; multi-line text (the repository's files) as
    literal blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def dump(documents: list[dict[str, Any]]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=120)


def write(out: Path, files: dict[str, list[dict[str, Any]]]) -> None:
    """``files`` into ``out``, after the files of the base rendered there before (those its kustomization lists: a
    tier gone from the topology leaves no file behind; nothing else in ``out`` is touched)."""
    out.mkdir(parents=True, exist_ok=True)
    kustomization = out / "kustomization.yaml"
    if kustomization.is_file():
        for name in (yaml.safe_load(kustomization.read_text()) or {}).get("resources", []):
            if "/" not in name and (out / name).is_file():
                (out / name).unlink()
    for name, documents in files.items():
        (out / name).write_text(dump(documents))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render a topology's Kubernetes manifests (a kustomize base).")
    parser.add_argument("topology", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the base's folder (kubectl apply -k OUT)")
    defaults = Options()
    for field, text in (("namespace", "the namespace, in every object and endpoint"), ("image", "the container image"),
                        ("checkpoint_claim", "the PersistentVolumeClaim with the checkpoint"),
                        ("prefix", "before each tier's name"), ("tritonserver", "the binary in the image")):
        parser.add_argument(f"--{field.replace('_', '-')}", default=getattr(defaults, field), help=text)
    parser.add_argument("--max-replicas", type=int, default=defaults.max_replicas, help="each autoscaler's ceiling")
    parser.add_argument("--no-validate", action="store_true", help="do not check the manifests against the API schemas")
    args = parser.parse_args(argv)
    options = Options(args.namespace, args.image, args.checkpoint_claim, args.prefix, args.max_replicas, args.tritonserver)
    try:
        files = manifests(load(args.topology, "gpu"), options)  # for the cluster's nodes, whatever this machine is
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = [] if args.no_validate else validate(files)
    if problems:
        print("error: the manifests do not validate:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    write(args.out, files)
    print(f"wrote {', '.join(files)} into {args.out}" + ("" if args.no_validate else
                                                           f" (valid against the Kubernetes {KUBERNETES_VERSION} API)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
