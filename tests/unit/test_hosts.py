"""One topology, many hosts (backend.deploy.hosts): the hosts block is checked naming the key, each host renders its
own models with the orchestrators' endpoints computed from the block, and each gets its launch command."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from backend.deploy.hosts import HostSpec, TRITONSERVER, host_plan, plan_host
from backend.deploy.render import render_files
from backend.deploy.schema import TopologyError
from backend.deploy.topology import load, main
from backend.protocol.settings import ColocatedSettings, ProxySettings, parse_settings
from tests.unit.test_model_config import triton_config

ROOT = Path(__file__).resolve().parents[2]
E_PD = ROOT / "topologies" / "hosts-e-pd.yaml"
E_P_D = ROOT / "topologies" / "hosts-e-p-d.yaml"


def param(config: str, key: str) -> str:
    return triton_config(config)["parameters"][key]["string_value"]


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _doc(path: Path = E_PD) -> dict:
    doc = yaml.safe_load(path.read_text())
    doc["checkpoint"] = str((path.parent / doc["checkpoint"]).resolve())
    return doc


def test_the_e_pd_hosts_render_their_own_models_with_endpoints_from_the_block(tmp_path):
    topology = load(E_PD, "cpu")
    assert topology.hosts == {
        "front": HostSpec("10.77.0.2", ("epd",), "eth0"), "encode-1": HostSpec("10.77.0.3", ("encoder",), "eth0"),
        "pd-1": HostSpec("10.77.0.4", ("pd",), "eth0")}
    plans = host_plan(topology, tmp_path)
    assert {name: plan.models for name, plan in plans.items()} == {"front": ("epd",), "encode-1": ("encoder",),
                                                                   "pd-1": ("pd",)}
    assert sorted(plans["pd-1"].files) == ["pd/1/model.py", "pd/config.pbtxt", "pd/model.json"]
    epd = plans["front"].files["epd/config.pbtxt"]
    assert (param(epd, "encoder_endpoint"), param(epd, "generator_endpoint")) == ("10.77.0.3:8001", "10.77.0.4:8001")
    settings = parse_settings(ProxySettings, "epd", triton_config(epd))  # what the orchestrator reads
    assert settings.encoder_endpoint == "10.77.0.3:8001" and settings.generator_endpoint == "10.77.0.4:8001"
    # the same models as one server would serve, with only the endpoints changed
    whole = render_files(topology, tmp_path / "front")
    assert plans["front"].files["epd/config.pbtxt"].replace("10.77.0.3:8001", "local").replace(
        "10.77.0.4:8001", "local") == whole["epd/config.pbtxt"]


def test_a_host_s_launch_command_binds_its_address_and_ports_and_names_its_interface(tmp_path):
    plan = host_plan(load(E_PD, "cpu"), tmp_path)["encode-1"]
    repository = (tmp_path / "encode-1").resolve()
    assert plan.repository == repository
    assert plan.argv == (str(TRITONSERVER), f"--model-repository={repository}", "--grpc-address=10.77.0.3",
                         "--grpc-port=8001", "--http-address=10.77.0.3", "--http-port=8000",
                         "--metrics-address=10.77.0.3", "--metrics-port=8002")
    assert plan.env == {"UCX_NET_DEVICES": "eth0", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.77.0.3", "EPD_HOST": "encode-1"}
    assert plan.command().startswith("env UCX_NET_DEVICES=eth0 VLLM_NIXL_SIDE_CHANNEL_HOST=10.77.0.3 EPD_HOST=encode-1 ")
    plan.write()
    written = {str(p.relative_to(repository)): p.read_text() for p in repository.rglob("*") if p.is_file()}
    assert written == plan.files
    model = param(plan.files["encoder/config.pbtxt"], "model")  # the checkpoint, relative to the repository
    assert (repository / "encoder" / model).resolve() == (ROOT / "models" / "tiny-qwen2-vl").resolve()


def test_the_e_p_d_orchestrator_beside_the_encoders_reaches_them_locally(tmp_path):
    plans = host_plan(load(E_P_D, "cpu"), tmp_path)
    assert plans["encode-1"].models == ("encoder", "epd") and plans["decode-1"].models == ("decode",)
    epd = plans["encode-1"].files["epd/config.pbtxt"]
    assert param(epd, "encoder_endpoint") == "local"  # BLS in the same server: the only encoder host is its own
    assert (param(epd, "prefill_endpoint"), param(epd, "decode_endpoint")) == ("10.77.0.3:8001", "10.77.0.4:8001")
    assert "count: 2 kind: KIND_CPU" in plans["encode-1"].files["encoder/config.pbtxt"]


def test_a_stage_on_several_hosts_is_that_many_replicas_in_the_endpoints(tmp_path):
    doc = _doc()
    doc["hosts"]["pd-2"] = {"address": "10.77.0.5", "interface": "eth0", "stages": ["pd"]}
    doc["hosts"]["front"]["stages"] = ["epd", "encoder"]  # an encoder beside the orchestrator and one elsewhere
    plans = host_plan(load(_write(tmp_path, doc), "cpu"), tmp_path / "out")
    epd = plans["front"].files["epd/config.pbtxt"]
    assert param(epd, "generator_endpoint") == "10.77.0.4:8001,10.77.0.5:8001"
    # not local: the encoder has a replica elsewhere; in the block's order (safe_dump sorted it: encode-1, front)
    assert param(epd, "encoder_endpoint") == "10.77.0.3:8001,10.77.0.2:8001"
    assert plans["pd-2"].files == plans["pd-1"].files  # replicas: the same repository


def test_hosts_on_one_address_with_their_own_ports(tmp_path):
    doc = _doc()
    doc["hosts"] = {"a": {"address": "127.0.0.1", "interface": "lo", "stages": ["epd", "encoder"]},
                    "b": {"address": "127.0.0.1", "interface": "lo", "stages": ["pd"], "grpc_port": 9001,
                          "http_port": 9000, "metrics_port": 9002},
                    "c": {"address": "fd00::3", "interface": "eth1", "stages": ["pd"]}}
    plans = host_plan(load(_write(tmp_path, doc), "cpu"), tmp_path / "out")
    assert param(plans["a"].files["epd/config.pbtxt"], "generator_endpoint") == "127.0.0.1:9001,[fd00::3]:8001"
    assert "--grpc-port=9001" in plans["b"].argv and "--grpc-address=fd00::3" in plans["c"].argv


def test_a_colocated_orchestrator_is_placed_with_its_host_stage(tmp_path):
    doc = {"checkpoint": "m", "serve": ["E+PD", "E/P/D"],
           "stages": {"encoder": {}, "pd": {"orchestrator": "colocated"}, "prefill": {"orchestrator": "colocated"},
                      "decode": {}},
           "hosts": {"e": {"address": "10.0.0.1", "interface": "eth0", "stages": ["encoder"]},
                     "pd-1": {"address": "10.0.0.2", "interface": "eth0", "stages": ["pd"]},
                     "p": {"address": "10.0.0.3", "interface": "eth0", "stages": ["prefill"]},
                     "d": {"address": "10.0.0.4", "interface": "eth0", "stages": ["decode"]},
                     "d-2": {"address": "10.0.0.5", "interface": "eth0", "stages": ["decode"]}}}
    plans = host_plan(load(_write(tmp_path, doc), "cpu"), tmp_path / "out")
    assert plans["pd-1"].models == ("epd",) and plans["p"].models == ("epd_disagg",)
    e_pd, e_p_d = plans["pd-1"].files["epd/config.pbtxt"], plans["p"].files["epd_disagg/config.pbtxt"]
    assert param(e_pd, "encoder_endpoint") == param(e_p_d, "encoder_endpoint") == "10.0.0.1:8001"
    assert param(e_p_d, "decode_endpoint") == "10.0.0.4:8001,10.0.0.5:8001"
    assert parse_settings(ColocatedSettings, "epd", triton_config(e_pd)).encoder_endpoint == "10.0.0.1:8001"
    doc["hosts"]["e"]["stages"] = ["encoder", "epd"]
    with pytest.raises(TopologyError, match=r"hosts.e.stages: epd: the orchestrator runs inside the pd and prefill "
                                            r"instances \(orchestrator: colocated\); place pd and prefill instead"):
        load(_write(tmp_path, doc), "cpu")


HOST = {"address": "10.0.0.1", "interface": "eth0", "stages": ["encoder", "pd", "epd"]}


@pytest.mark.parametrize("hosts, message", [
    ([], "hosts: expected a mapping of host name"),
    ({"A": HOST}, "hosts: host name 'A': expected a DNS label"),
    ({"a_b": HOST}, "host name 'a_b'"),
    ({"a": {**HOST, "replicas": 2}}, "hosts.a: unknown key(s) replicas"),
    ({"a": {k: v for k, v in HOST.items() if k != "address"}}, "hosts.a.address: required"),
    ({"a": {k: v for k, v in HOST.items() if k != "interface"}}, "hosts.a.interface: required"),
    ({"a": {k: v for k, v in HOST.items() if k != "stages"}}, "hosts.a.stages: required"),
    ({"a": {**HOST, "address": "0.0.0.0"}}, "hosts.a.address: 0.0.0.0 binds every address but reaches none"),
    ({"a": {**HOST, "address": "bad host"}}, "hosts.a.address: expected an IP address or DNS name, got 'bad host'"),
    ({"a": {**HOST, "address": 10}}, "hosts.a.address: expected an IP address or DNS name, got 10"),
    ({"a": {**HOST, "interface": "eth 0"}}, "hosts.a.interface: expected a network device name"),
    ({"a": {**HOST, "grpc_port": 0}}, "hosts.a.grpc_port: expected a port number from 1 to 65535, got 0"),
    ({"a": {**HOST, "http_port": "8000"}}, "hosts.a.http_port: expected a port number"),
    ({"a": {**HOST, "metrics_port": 8001}}, "hosts: a.grpc_port and a.metrics_port are both 10.0.0.1:8001"),
    ({"a": HOST, "b": {**HOST, "stages": ["pd"], "grpc_port": 8000, "http_port": 9000}},
     "hosts: a.http_port and b.grpc_port are both 10.0.0.1:8000"),
    ({"a": {**HOST, "stages": []}}, "hosts.a.stages: expected a non-empty list of the topology's stages"),
    ({"a": {**HOST, "stages": ["pd", "pd"]}}, "hosts.a.stages: pd listed more than once"),
    ({"a": {**HOST, "stages": ["encoder", "pd", "epd", "decode"]}},
     "hosts.a.stages: 'decode' is not a stage of this topology (its stages: encoder, epd, pd)"),
    ({"a": {**HOST, "stages": ["encoder", "epd"]}}, "hosts: pd on no host (every stage the served deployments use"),
])
def test_a_bad_hosts_block_is_refused_naming_the_key(tmp_path, hosts, message):
    doc = {"checkpoint": "m", "serve": ["E+PD"], "stages": {"encoder": {}, "pd": {}, "epd": {}}, "hosts": hosts}
    with pytest.raises(TopologyError) as info:
        load(_write(tmp_path, doc), "cpu")
    assert message in str(info.value)


def test_what_the_hosts_block_decides_cannot_be_said_elsewhere(tmp_path):
    doc = _doc()
    doc["stages"]["pd"]["endpoint"] = "10.77.0.9:8001"
    with pytest.raises(TopologyError, match="stages.pd.endpoint: the hosts block places the stages"):
        load(_write(tmp_path, doc), "cpu")
    doc = _doc()
    doc["tier"] = {"bytes": 1 << 20}  # a tier the launcher would start: one per host, and these commands start none
    with pytest.raises(TopologyError, match="tier: with a hosts block give tier.master and tier.metadata"):
        load(_write(tmp_path, doc), "cpu")
    doc["tier"].update(master="10.77.0.9:50051", metadata="http://10.77.0.9:8080/metadata")
    assert load(_write(tmp_path, doc), "cpu").tier["master"] == "10.77.0.9:50051"
    with pytest.raises(TopologyError, match="its hosts block places the stages"):
        load(E_PD, "cpu").with_orchestrator("colocated")


def test_without_a_hosts_block_nothing_changes(tmp_path):
    topology = load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu")
    assert topology.hosts == {}
    with pytest.raises(TopologyError, match="no hosts block: one server serves it"):
        host_plan(topology, tmp_path)
    with pytest.raises(TopologyError, match="no host 'pd-9' in its hosts block \\(front, encode-1, pd-1\\)"):
        plan_host(load(E_PD, "cpu"), "pd-9", tmp_path)


def test_serving_part_of_a_topology_keeps_the_hosts_of_its_stages(tmp_path):
    doc = _doc()
    doc["serve"] = ["baseline", "E+PD"]
    doc["stages"]["llm"] = {}
    doc["hosts"]["llm-1"] = {"address": "10.77.0.9", "interface": "eth0", "stages": ["llm"]}
    doc["hosts"]["pd-1"]["stages"] = ["pd", "llm"]
    both = load(_write(tmp_path, doc), "cpu")
    alone = both.only("E+PD")
    assert set(alone.hosts) == {"front", "encode-1", "pd-1"} and alone.hosts["pd-1"].stages == ("pd",)
    assert host_plan(alone, tmp_path / "out")["pd-1"].models == ("pd",)
    assert host_plan(both, tmp_path / "both")["pd-1"].models == ("llm", "pd")


def test_the_cli_renders_one_host_or_all_with_their_launch_commands(tmp_path, capsys):
    assert main(["render", str(E_PD), "--host", "pd-1", "--out", str(tmp_path / "pd")]) == 0
    assert sorted(p.name for p in (tmp_path / "pd").iterdir()) == ["pd"]
    assert main(["hosts", str(E_P_D), "--out", str(tmp_path / "all"), "--tritonserver", "/opt/tritonserver"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["decode-1", "encode-1", "prefill-1"]
    assert ("env UCX_NET_DEVICES=eth0 VLLM_NIXL_SIDE_CHANNEL_HOST=10.77.0.4 EPD_HOST=decode-1 /opt/tritonserver "
            f"--model-repository={(tmp_path / 'all' / 'decode-1').resolve()} --grpc-address=10.77.0.4") in out
    assert main(["render", str(E_PD), "--out", str(tmp_path / "one")]) == 0  # one server with every stage, all local
    assert "(one server; its hosts: render --host front|encode-1|pd-1)" in capsys.readouterr().out
    assert param((tmp_path / "one" / "epd" / "config.pbtxt").read_text(), "encoder_endpoint") == "local"
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["encoder", "epd", "pd"]
    for argv, message in ((["render", str(ROOT / "topologies" / "cpu-e-pd.yaml"), "--host", "a", "--out",
                            str(tmp_path / "x")], "no hosts block"),
                          (["hosts", str(E_PD), "--host", "front", "--out", str(tmp_path / "x")], "--host goes with render")):
        assert main(argv) == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_every_host_s_rendered_configs_parse_into_their_settings(tmp_path):
    for path in (E_PD, E_P_D):
        topology = load(path, "cpu")
        kinds = topology.models()
        for plan in host_plan(topology, tmp_path / path.stem).values():
            for model in plan.models:
                parse_settings(kinds[model].settings, model, triton_config(plan.files[f"{model}/config.pbtxt"]))
            for name, text in plan.files.items():
                if name.endswith("model.json"):
                    assert json.loads(text)["model"], name
