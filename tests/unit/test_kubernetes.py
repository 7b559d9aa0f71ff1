"""Kubernetes manifests (backend.deploy.kubernetes): every shipped topology renders a kustomize base whose objects
validate against the Kubernetes API schemas offline (kubernetes-validate, strict), a broken object is refused, and the
tiers, endpoints, GPUs, probes and autoscalers are what the topology says."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from backend.deploy.kubernetes import (CHECKPOINT, KUBERNETES_VERSION, REPOSITORY, SCALE_ON, Options, dump, main,
                                       manifests, tiers, validate)
from backend.deploy.schema import TopologyError
from backend.deploy.topology import load
from tests.unit.test_model_config import triton_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))


def objects(files: dict, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for docs in files.values() for doc in docs if doc["kind"] == kind}


def repository(files: dict, tier: str) -> dict[str, str]:
    """A tier's model repository as its pods see it: the ConfigMap's keys put at their volume items' paths."""
    data = objects(files, "ConfigMap")[f"{tier}-repository"]["data"]
    volume = objects(files, "Deployment")[tier]["spec"]["template"]["spec"]["volumes"][0]["configMap"]
    return {item["path"]: data[item["key"]] for item in volume["items"]}


def param(files: dict, tier: str, model: str, key: str) -> str:
    return triton_config(repository(files, tier)[f"{model}/config.pbtxt"])["parameters"][key]["string_value"]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_topology_renders_manifests_valid_against_the_api_schemas(path):
    topology = load(path, "gpu")
    files = manifests(topology)
    assert validate(files) == [], f"{path.name} against Kubernetes {KUBERNETES_VERSION}"
    assert files["kustomization.yaml"][0]["resources"] == [name for name in files if name != "kustomization.yaml"]
    deployments, services, scalers = (objects(files, kind) for kind in ("Deployment", "Service", "HorizontalPodAutoscaler"))
    assert set(deployments) == set(services) == set(scalers) == set(tiers(topology))
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == labels == services[name]["spec"]["selector"]
        assert services[name]["spec"]["clusterIP"] == "None"  # headless: its DNS name is every ready pod's address
        assert scalers[name]["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        served = {path.split("/")[0] for path in repository(files, name)}
        assert served and served <= set(topology.models())
    assert {model for name in deployments for model in {p.split("/")[0] for p in repository(files, name)}} == \
        set(topology.models())  # every model in exactly one tier
    for name, documents in files.items():  # what is written reads back as rendered
        assert list(yaml.safe_load_all(dump(documents))) == documents, name


def test_a_broken_manifest_is_refused_naming_the_field():
    files = manifests(load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu"))
    broken = copy.deepcopy(files)
    deployment = objects(broken, "Deployment")["pd"]
    deployment["spec"]["replicas"] = "two"
    encoder = objects(broken, "Deployment")["encoder"]["spec"]["template"]["spec"]["containers"][0]
    encoder["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    objects(broken, "Service")["pd"]["spec"]["ports"][0]["port"] = "grpc"
    objects(broken, "HorizontalPodAutoscaler")["pd"]["apiVersion"] = "autoscaling/v9"
    problems = validate(broken)
    assert len(problems) == 4, problems
    assert any(p.startswith("pd.yaml: Deployment/pd: spec.replicas: 'two' is not of type 'integer'") for p in problems)
    assert any(p.startswith("encoder.yaml: Deployment/encoder: spec.template.spec.containers.0.readinessProbe.httpGet:")
               and "'paht'" in p for p in problems), problems  # strict: an unknown field
    assert any(p.startswith("pd.yaml: Service/pd: spec.ports.0.port:") for p in problems)
    assert any("HorizontalPodAutoscaler with api version autoscaling/v9" in p for p in problems)
    assert validate(files) == []


def test_without_hosts_each_stage_is_a_tier_and_the_endpoints_are_service_names():
    files = manifests(load(ROOT / "topologies" / "default.yaml", "cpu"), Options(namespace="vision"))
    assert list(tiers(load(ROOT / "topologies" / "default.yaml", "cpu"))) == [
        "encoder", "llm", "pd", "prefill", "decode", "epd"]
    assert sorted(p.split("/")[0] for p in repository(files, "epd") if p.endswith("config.pbtxt")) == ["epd", "epd_disagg"]
    dns = "{}.vision.svc.cluster.local:8001".format
    assert param(files, "epd", "epd", "encoder_endpoint") == dns("encoder")  # the encoders scale apart: over gRPC
    assert param(files, "epd", "epd", "generator_endpoint") == dns("pd")
    assert (param(files, "epd", "epd_disagg", "prefill_endpoint"), param(files, "epd", "epd_disagg", "decode_endpoint")) \
        == (dns("prefill"), dns("decode"))
    assert {doc["metadata"]["namespace"] for docs in files.values() for doc in docs if "namespace" in doc.get("metadata", {})} \
        == {"vision"}
    colocated = manifests(load(ROOT / "topologies" / "cpu-e-p-d-colocated.yaml", "cpu"))
    assert list(tiers(load(ROOT / "topologies" / "cpu-e-p-d-colocated.yaml", "cpu"))) == ["encoder", "prefill", "decode"]
    assert param(colocated, "prefill", "epd", "decode_endpoint") == "decode.epd.svc.cluster.local:8001"
    assert param(colocated, "prefill", "epd", "encoder_endpoint") == "encoder.epd.svc.cluster.local:8001"
    in_process = load(ROOT / "topologies" / "cpu-e-p-d-colocated.yaml", "cpu").with_decode_in_process()
    assert list(tiers(in_process)) == ["encoder", "prefill-decode"]  # decode's engine runs in prefill's pods
    both = manifests(in_process)
    assert param(both, "prefill-decode", "epd", "decode_in_process") == "true"
    assert sorted(p.split("/")[0] for p in repository(both, "prefill-decode") if p.endswith("config.pbtxt")) == ["epd"]


def test_hosts_with_the_same_stages_are_one_tier_of_that_many_replicas(tmp_path):
    doc = yaml.safe_load((ROOT / "topologies" / "hosts-e-pd.yaml").read_text())
    doc["checkpoint"] = str(ROOT / "models" / "tiny-qwen2-vl")
    doc["hosts"]["pd-2"] = {"address": "10.77.0.5", "interface": "eth0", "stages": ["pd"]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    topology = load(tmp_path / "t.yaml", "cpu")
    assert {name: (t.stages, t.replicas) for name, t in tiers(topology).items()} == {
        "epd": (("epd",), 1), "encoder": (("encoder",), 1), "pd": (("pd",), 2)}
    files = manifests(topology, Options(prefix="demo-", max_replicas=6))
    assert objects(files, "Deployment")["demo-pd"]["spec"]["replicas"] == 2
    assert objects(files, "HorizontalPodAutoscaler")["demo-pd"]["spec"]["minReplicas"] == 2
    assert objects(files, "HorizontalPodAutoscaler")["demo-pd"]["spec"]["maxReplicas"] == 6
    assert param(files, "demo-epd", "epd", "generator_endpoint") == "demo-pd.epd.svc.cluster.local:8001"
    e_p_d = manifests(load(ROOT / "topologies" / "hosts-e-p-d.yaml", "cpu"))
    assert param(e_p_d, "encoder-epd", "epd", "encoder_endpoint") == "local"  # the encoders are in its own pods
    assert param(e_p_d, "encoder-epd", "epd", "decode_endpoint") == "decode.epd.svc.cluster.local:8001"
    for prefix, options in (("Bad", Options(prefix="Bad")), ("namespace", Options(namespace="a_b"))):
        with pytest.raises(TopologyError, match=prefix):
            manifests(topology, options)


def test_a_pod_runs_tritonserver_with_probes_pod_networking_and_its_gpus():
    files = manifests(load(ROOT / "topologies" / "gpu-e-p-d.yaml", "gpu"), Options(image="registry/epd:1"))
    pod = objects(files, "Deployment")["prefill"]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["image"] == pod["initContainers"][0]["image"] == "registry/epd:1"
    assert server["command"][:2] == ["tritonserver", f"--model-repository={REPOSITORY}"]
    assert "--grpc-address=0.0.0.0" in server["command"] and "--grpc-port=8001" in server["command"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == server["startupProbe"]["httpGet"] == {"path": "/v2/health/live",
                                                                                       "port": "http"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in server["env"]}
    assert env == {"UCX_NET_DEVICES": "eth0", "VLLM_NIXL_SIDE_CHANNEL_HOST": {"fieldRef": {"fieldPath": "status.podIP"}},
                   "EPD_HOST": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert server["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    assert "kind: KIND_GPU gpus: [ 0 ]" in repository(files, "prefill")["prefill/config.pbtxt"]  # its GPU 1, as the pod's 0
    assert "resources" not in objects(files, "Deployment")["epd"]["spec"]["template"]["spec"]["containers"][0]
    model = triton_config(repository(files, "encoder")["encoder/config.pbtxt"])["parameters"]["model"]["string_value"]
    assert os.path.normpath(os.path.join(REPOSITORY, "encoder", model)) == CHECKPOINT
    assert pod["volumes"][2]["persistentVolumeClaim"] == {"claimName": "epd-checkpoint", "readOnly": True}


def test_each_tier_scales_on_a_metric_the_project_exports():
    files = manifests(load(ROOT / "topologies" / "hosts-e-p-d.yaml", "cpu"))
    scalers = objects(files, "HorizontalPodAutoscaler")
    targets = {name: [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in s["spec"]["metrics"]]
               for name, s in scalers.items()}
    assert targets == {"encoder-epd": [("epd_pool_used_bytes", str(67108864 // 2)), ("epd_requests_per_second", "50")],
                       "prefill": [("epd_vllm_kv_cache_usage", "700m")], "decode": [("epd_vllm_kv_cache_usage", "700m")]}
    source = (ROOT / "backend" / "triton" / "metrics.py").read_text()
    for name, _ in SCALE_ON.values():  # a rate is the adapter's name for a counter's rate (docs/operations.md)
        assert f'"{name.replace("_per_second", "_total")}"' in source, name


def test_the_cli_writes_a_kustomize_base_and_replaces_its_own_files_only(tmp_path, capsys):
    out = tmp_path / "base"
    out.mkdir()
    (out / "notes.yaml").write_text("mine: true\n")
    assert main([str(ROOT / "topologies" / "default.yaml"), "--out", str(out), "--namespace", "vision"]) == 0
    assert "valid against the Kubernetes 1.37 API" in capsys.readouterr().out
    assert (out / "llm.yaml").is_file() and yaml.safe_load((out / "kustomization.yaml").read_text())["resources"][0] == \
        "namespace.yaml"
    assert main([str(ROOT / "topologies" / "cpu-e-pd.yaml"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["encoder.yaml", "epd.yaml", "kustomization.yaml", "namespace.yaml",
                                                     "notes.yaml", "pd.yaml"]  # llm's is gone, notes.yaml is kept
    assert main([str(ROOT / "topologies" / "cpu-e-pd.yaml"), "--out", str(out), "--namespace", "Vision"]) == 2
    assert "not a namespace name" in capsys.readouterr().err
