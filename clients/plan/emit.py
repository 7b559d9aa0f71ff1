"""A plan written out: the topology (with its ``hosts:`` block, one host per replica, and the engine arguments the plan
assumed) and its Kubernetes base (``backend.deploy.kubernetes``, the autoscalers' targets the plan derived), both
checked by the project's own loaders.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from backend.deploy import kubernetes
from backend.deploy.topology import load
from clients.plan.simulate import Layout

SPLITS = ("E+PD", "E/P/D")  # what the planner writes (not its llm candidates)


def topology_doc(layout: Layout, checkpoint: str, device: str, name: str, engine_args: dict) -> dict:
    """The topology of ``layout``: its stages and one host per replica (10.77.0.x addresses, the namespaces' plan;
    a cluster's pods get their own), the orchestrator on a host of its own, its engines' ``engine_args`` (the plan's:
    ``planner.engine_args``)."""
    if layout.split not in SPLITS:
        raise ValueError(f"{layout.split}: the planner writes E+PD and E/P/D topologies")
    engines = layout.engines()
    gpu = {"device": "gpu", "gpus": [0]} if device == "gpu" else {"device": "cpu"}
    stages = {"encoder": {"instances": layout.encoder_instances, **gpu},
              **{stage: {"instances": 1, **gpu} for stage in engines}, "epd": {"instances": layout.orchestrators}}
    hosts, address = {"front": {"address": "10.77.0.2", "interface": "eth0", "stages": ["epd"]}}, 3
    for stage, count in (("encoder", layout.encoders), *engines.items()):
        for n in range(1, count + 1):
            prefix = "encode" if stage == "encoder" else stage
            hosts[f"{prefix}-{n}"] = {"address": f"10.77.{address // 250}.{address % 250 + 2}", "interface": "eth0",
                                      "stages": [stage]}
            address += 1
    return {"name": name, "checkpoint": checkpoint, "serve": [layout.split], "stages": stages,
            "engine_args": engine_args, "transfer": {"pool_bytes": 67108864, "lease_seconds": 30},
            "limits": {"max_images": 4}, "hosts": hosts}


def write(result: dict, out: Path, checkpoint: str, device: str, name: str, max_replicas: int) -> list[str]:
    """``topology.yaml``, ``kubernetes/`` and ``plan.json`` into ``out``; the Kubernetes validation's problems ([]
    when none)."""
    out.mkdir(parents=True, exist_ok=True)
    layout: Layout = result["chosen"]
    doc = topology_doc(layout, checkpoint, device, name, result["engine_args"])
    path = out / "topology.yaml"
    header = (f"# {name}: written by clients.plan.planner ({layout.label()}, {result['budget']} devices budgeted);"
              f" the autoscalers' targets: plan.json\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    topology = load(path, device)
    targets = tuple((stage, t["target"]) for stage, t in result["targets"].items())
    options = kubernetes.Options(targets=targets, max_replicas=max_replicas)
    files = kubernetes.manifests(topology, options)
    problems = kubernetes.validate(files)
    kubernetes.write(out / "kubernetes", files)
    saved = {**result, "chosen": layout.label(), "layout": {k: v for k, v in vars(layout).items()}}
    (out / "plan.json").write_text(json.dumps(saved, indent=1, default=str) + "\n")
    return problems
