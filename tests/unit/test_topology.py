import json
from pathlib import Path

import pytest
import yaml

from backend.deploy.schema import TopologyError

from backend.deploy.render import render_files
from backend.deploy.topology import load
from backend.engine.host import load_engine_args
from backend.protocol.settings import ConfigError, EncoderSettings, VideoDecoder, parse_settings

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "topologies" / "default.yaml"


def test_committed_repository_is_the_rendering_of_the_default_topology():
    repo = ROOT / "model_repository"
    expected = render_files(load(DEFAULT, "cpu"), repo)
    on_disk = {str(p.relative_to(repo)): p.read_text() for p in repo.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk == expected, "re-render: python -m backend.deploy.topology render topologies/default.yaml --out model_repository"


@pytest.mark.parametrize("name", ["default", "cpu-e-pd", "cpu-e-p-d", "cpu-e-pd-colocated", "cpu-e-p-d-colocated", "cpu-e-p-d-one-process",
                                  "cpu-e-pd-tier", "hosts-e-pd", "hosts-e-p-d"])
def test_cpu_topologies_validate(name):
    load(ROOT / "topologies" / f"{name}.yaml", "cpu")


def test_two_encoder_e_p_d_rendering():
    topology = load(ROOT / "topologies" / "cpu-e-p-d.yaml", "cpu")
    assert topology.models() == {"encoder": "encoder", "prefill": "prefill", "decode": "decode", "epd": "epd:E/P/D"}
    files = render_files(topology, Path("/r"))
    assert "count: 2 kind: KIND_CPU" in files["encoder/config.pbtxt"]
    assert 'key: "topology" value: { string_value: "E/P/D" }' in files["epd/config.pbtxt"]


def test_one_deployment_alone_with_engine_overrides(tmp_path):
    topology = load(DEFAULT, "cpu").only("E/P/D", {"enforce_eager": False})
    assert topology.models() == {"encoder": "encoder", "prefill": "prefill", "decode": "decode", "epd": "epd:E/P/D"}
    files = render_files(topology, tmp_path / "repo")
    assert '"enforce_eager": false' in files["decode/model.json"]
    assert (tmp_path / "repo" / "decode" / json.loads(files["decode/model.json"])["model"]).resolve() == \
        (ROOT / "models" / "tiny-qwen2-vl").resolve()
    assert load(DEFAULT, "cpu").only("baseline").models() == {"llm": "llm"}
    assert load(DEFAULT, "cpu").only(("baseline", "E+PD")).models() == {"llm": "llm", "encoder": "encoder", "pd": "pd",
                                                                          "epd": "epd:E+PD"}  # what make demo serves
    with pytest.raises(TopologyError, match="no settings for llm"):
        load(ROOT / "topologies" / "cpu-e-pd.yaml", "cpu").only("baseline")
    for name in ("cpu-e-pd-colocated", "cpu-e-p-d-colocated"):  # a colocated deployment has no epd stage to need
        colocated = load(ROOT / "topologies" / f"{name}.yaml", "cpu")
        assert colocated.only(colocated.serve[0]).models() == colocated.models()


def test_colocated_orchestrator_renders_one_epd_model_with_pd_s_engine_and_instances():
    topology = load(ROOT / "topologies" / "cpu-e-pd-colocated.yaml", "cpu")
    assert topology.colocated == ("E+PD",) and topology.models() == {"encoder": "encoder", "epd": "epd:E+PD:colocated"}
    files = render_files(topology, Path("/r"))
    assert sorted(files) == ["encoder/1/model.py", "encoder/config.pbtxt", "epd/1/model.py", "epd/config.pbtxt",
                             "epd/model.json"]  # no pd model: its engine runs in epd
    config = files["epd/config.pbtxt"]
    assert "from backend.triton.models.colocated import TritonPythonModel" in files["epd/1/model.py"]
    assert 'name: "image" data_type: TYPE_STRING' in config and "image_layouts" not in config  # llm's interface
    assert 'name: "timings"' in config and "decoupled: true" in config
    assert 'key: "orchestrator" value: { string_value: "colocated" }' in config
    assert 'key: "encoder_model" value: { string_value: "encoder" }' in config
    assert json.loads(files["epd/model.json"])["limit_mm_per_prompt"] == {"image": 4, "video": 2, "audio": 3}


def test_colocated_beside_e_p_d_keeps_the_proxy_for_e_p_d():
    topology = load(DEFAULT, "cpu").with_orchestrator("colocated")
    assert topology.models() == {"llm": "llm", "encoder": "encoder", "epd": "epd:E+PD:colocated",
                                 "prefill": "prefill", "decode": "decode", "epd_disagg": "epd:E/P/D"}
    files = render_files(topology, Path("/r"))
    assert "backend.triton.models.epd" in files["epd_disagg/1/model.py"] and "pd/config.pbtxt" not in files
    alone = load(DEFAULT, "cpu").only("E+PD").with_orchestrator("colocated")
    assert alone.models() == {"encoder": "encoder", "epd": "epd:E+PD:colocated"} and "epd" not in alone.stages
    assert alone.with_orchestrator("proxy").models() == {"encoder": "encoder", "pd": "pd", "epd": "epd:E+PD"}
    with pytest.raises(TopologyError, match="expected one of proxy, colocated"):
        alone.with_orchestrator("inline")
    with pytest.raises(TopologyError, match="E\\+PD has no orchestrator to place here \\(served: E/P/D"):
        load(ROOT / "topologies" / "cpu-e-p-d.yaml", "cpu").with_orchestrator("colocated")


def test_e_p_d_orchestrator_colocated_with_prefill_renders_one_epd_model_with_prefill_s_engine():
    topology = load(ROOT / "topologies" / "cpu-e-p-d-colocated.yaml", "cpu")
    assert topology.colocated == ("E/P/D",) and "epd" not in topology.stages
    assert topology.models() == {"encoder": "encoder", "epd": "epd:E/P/D:colocated", "decode": "decode"}
    files = render_files(topology, Path("/r"))
    assert "prefill/config.pbtxt" not in files and "decode/config.pbtxt" in files  # prefill's engine runs in epd
    assert "from backend.triton.models.colocated import TritonPythonModel" in files["epd/1/model.py"]
    config = files["epd/config.pbtxt"]
    assert 'name: "image" data_type: TYPE_STRING' in config and "image_layouts" not in config  # llm's interface
    assert 'name: "kv_transfer_params"' not in config and 'name: "timings"' in config and "decoupled: true" in config
    for key, value in (("topology", "E/P/D"), ("orchestrator", "colocated"), ("decode_model", "decode"),
                       ("encoder_model", "encoder"), ("nixl_poll_delay_us", "5000")):
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in config, key
    assert json.loads(files["epd/model.json"]) == json.loads(files["decode/model.json"])  # prefill's = decode's args


def test_decode_colocated_runs_its_engine_in_e_p_d_s_orchestrator_and_has_no_model(tmp_path):
    doc = yaml.safe_load((ROOT / "topologies" / "cpu-e-p-d-colocated.yaml").read_text())
    doc["checkpoint"] = str(ROOT / "models" / "tiny-qwen2-vl")
    doc["stages"]["prefill"]["instances"] = 2
    doc["stages"]["decode"] = {"orchestrator": "colocated"}  # instances and device: prefill's
    topology = load(_write(tmp_path, doc), "cpu")
    assert topology.decode_in_process and topology.stages["decode"].instances == 2
    assert topology.models() == {"encoder": "encoder", "epd": "epd:E/P/D:colocated"}
    files = render_files(topology, Path("/r"))
    assert not any(name.startswith(("decode/", "prefill/")) for name in files)
    config = files["epd/config.pbtxt"]
    assert 'key: "decode_in_process" value: { string_value: "true" }' in config and "decode_model" not in config
    assert 'key: "nixl_poll_delay_us" value: { string_value: "5000" }' in config and "decode_in_process)" in config
    assert "count: 2 kind: KIND_CPU" in config
    same = load(DEFAULT, "cpu").with_orchestrator("colocated", "E/P/D").with_decode_in_process()
    assert same.models() == {"llm": "llm", "encoder": "encoder", "pd": "pd", "epd": "epd:E+PD", "epd_disagg": "epd:E/P/D:colocated"}
    assert same.only("E/P/D").models() == {"encoder": "encoder", "epd": "epd:E/P/D:colocated"}


@pytest.mark.parametrize("change, message", [
    ({"prefill": {}}, "it needs stages.prefill.orchestrator: colocated"),
    ({"decode": {"orchestrator": "colocated", "instances": 2}}, "give it prefill's instances, device and gpus"),
    ({"encoder": {"orchestrator": "colocated"}}, "only pd .E\\+PD's. or prefill .E/P/D's. can host an orchestrator"),
])
def test_decode_colocated_needs_prefill_s_orchestrator_and_instances(tmp_path, change, message):
    doc = yaml.safe_load((ROOT / "topologies" / "cpu-e-p-d-colocated.yaml").read_text())
    doc["checkpoint"] = str(ROOT / "models" / "tiny-qwen2-vl")
    doc["stages"]["decode"] = {"orchestrator": "colocated"}
    doc["stages"].update(change)
    with pytest.raises(TopologyError, match=message):
        load(_write(tmp_path, doc), "cpu")
    with pytest.raises(TopologyError, match="E/P/D's orchestrator must be colocated with prefill"):
        load(DEFAULT, "cpu").with_decode_in_process()


def test_each_deployment_places_its_own_orchestrator():
    both = load(DEFAULT, "cpu").with_orchestrator("colocated").with_orchestrator("colocated", "E/P/D")
    assert both.colocated == ("E+PD", "E/P/D") and "epd" not in both.stages
    assert both.models() == {"llm": "llm", "encoder": "encoder", "epd": "epd:E+PD:colocated",
                             "epd_disagg": "epd:E/P/D:colocated", "decode": "decode"}
    assert 'key: "topology" value: { string_value: "E/P/D" }' in render_files(both, Path("/r"))["epd_disagg/config.pbtxt"]
    only_e_p_d = load(DEFAULT, "cpu").with_orchestrator("colocated", "E/P/D")
    assert only_e_p_d.models() == {"llm": "llm", "encoder": "encoder", "pd": "pd", "epd": "epd:E+PD",
                                   "epd_disagg": "epd:E/P/D:colocated", "decode": "decode"} and "epd" in only_e_p_d.stages
    alone = load(DEFAULT, "cpu").only("E/P/D").with_orchestrator("colocated", "E/P/D")
    assert alone.models() == {"encoder": "encoder", "epd": "epd:E/P/D:colocated", "decode": "decode"}
    assert alone.with_orchestrator("proxy", "E/P/D").models() == {"encoder": "encoder", "prefill": "prefill",
                                                                  "decode": "decode", "epd": "epd:E/P/D"}
    with pytest.raises(TopologyError, match="baseline has no orchestrator"):
        load(DEFAULT, "cpu").with_orchestrator("colocated", "baseline")


def param(config: str, key: str) -> str:
    """The value of parameter ``key`` in a rendered config.pbtxt."""
    return next(line for line in config.splitlines() if f'key: "{key}"' in line).split('string_value: "')[1].split('"')[0]


def test_stage_endpoints_render_into_the_orchestrators(tmp_path):
    files = render_files(load(DEFAULT, "cpu"), Path("/r"))  # local: this server's gRPC endpoint, whatever its port
    assert param(files["epd/config.pbtxt"], "generator_endpoint") == "local"
    assert param(files["epd_disagg/config.pbtxt"], "prefill_endpoint") == param(files["epd_disagg/config.pbtxt"], "decode_endpoint") == "local"
    doc = {"checkpoint": "m", "serve": ["E/P/D"], "stages": {"encoder": {}, "prefill": {"endpoint": "10.0.0.2:9001"},
                                                           "decode": {"endpoint": "decode-host:8001"}, "epd": {}}}
    config = render_files(load(_write(tmp_path, doc), "cpu"), Path("/r"))["epd/config.pbtxt"]
    assert (param(config, "prefill_endpoint"), param(config, "decode_endpoint")) == ("10.0.0.2:9001", "decode-host:8001")
    assert param(config, "encoder_endpoint") == "local"  # BLS in this server
    doc["stages"] = {"encoder": {"endpoint": "e1:8001,e2:8001"}, "prefill": {"orchestrator": "colocated"},
                     "decode": {"endpoint": "d:7,d2:7"}}
    config = render_files(load(_write(tmp_path, doc), "cpu"), Path("/r"))["epd/config.pbtxt"]  # one address per replica
    assert (param(config, "decode_endpoint"), param(config, "encoder_endpoint")) == ("d:7,d2:7", "e1:8001,e2:8001")


def test_gpu_topology_renders_gpu_instances_on_a_gpu_machine_only():
    path = ROOT / "topologies" / "gpu-e-p-d.yaml"
    files = render_files(load(path, "gpu"), Path("/r"))
    assert "kind: KIND_GPU gpus: [ 1 ]" in files["prefill/config.pbtxt"]
    with pytest.raises(TopologyError, match="gpu asked for, but this machine kind is cpu"):
        load(path, "cpu")


def test_an_nvdec_encoder_renders_its_video_decoder_and_a_cpu_one_nothing(tmp_path):
    doc = {"checkpoint": "m", "serve": ["E+PD"],
           "stages": {"encoder": {"device": "gpu", "video_decoder": "nvdec"}, "pd": {"device": "gpu"}, "epd": {}}}
    config = render_files(load(_write(tmp_path, doc), "gpu"), Path("/r"))["encoder/config.pbtxt"]
    assert param(config, "video_decoder") == "nvdec"
    assert "video_decoder" not in render_files(load(DEFAULT, "cpu"), Path("/r"))["encoder/config.pbtxt"]
    settings = parse_settings(EncoderSettings, "encoder", {"parameters": {"video_decoder": {"string_value": "nvdec"}}})
    assert settings.video_decoder is VideoDecoder.NVDEC
    with pytest.raises(ConfigError, match="video_decoder.*expected one of cpu, nvdec"):
        parse_settings(EncoderSettings, "encoder", {"parameters": {"video_decoder": {"string_value": "gpu"}}})


def _write(tmp_path, doc) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


BASE = {"checkpoint": "m", "serve": ["E+PD"], "stages": {"encoder": {"instances": 1}, "pd": {}, "epd": {}}}


@pytest.mark.parametrize("change, fragment", [
    ({"colour": "red"}, "unknown key(s) colour"),
    ({"serve": ["E+P+D"]}, "serve must list distinct deployments"),
    ({"serve": []}, "serve must list"),
    ({"checkpoint": ""}, "checkpoint"),
    ({"stages": {"encoder": {"instances": 0}}}, "stages.encoder.instances: expected an integer from 1 to 16"),
    ({"stages": {"encoder": {"instances": 99}}}, "from 1 to 16"),
    ({"stages": {"encoder": {"instances": "two"}}}, "expected an integer"),
    ({"stages": {"encoder": {"replicas": 2}}}, "stages.encoder: unknown key(s) replicas"),
    ({"stages": {"prefill": {}}}, "stages: prefill not used by serve"),
    ({"stages": {"encoder": {"device": "tpu"}}}, "device: expected cpu or gpu"),
    ({"stages": {"encoder": {"device": "gpu"}}}, "gpu asked for, but this machine kind is cpu"),
    ({"stages": {"epd": {"device": "gpu"}}}, "runs on CPU only"),
    ({"stages": {"encoder": {"gpus": [0]}}}, "only for device: gpu"),
    ({"transfer": {"pool_bytes": -1}}, "transfer.pool_bytes: expected a positive number"),
    ({"transfer": {"pool": 1}}, "transfer: unknown key(s) pool"),
    ({"engine_args": {"model": "x"}}, "the model is 'checkpoint'"),
    ({"stages": {"encoder": {}, "pd": {"orchestrator": "inline"}, "epd": {}}}, "stages.pd.orchestrator: expected one of proxy, colocated"),
    ({"stages": {"encoder": {}, "pd": {"orchestrator": "colocated"}, "epd": {}}}, "stages: epd not used by serve"),
    ({"stages": {"encoder": {"orchestrator": "colocated"}, "pd": {}, "epd": {}}}, "stages.encoder.orchestrator: only pd (E+PD's) or prefill"),
    ({"serve": ["E/P/D"], "stages": {"encoder": {}, "prefill": {}, "decode": {"orchestrator": "colocated"}, "epd": {}}},
     "stages.decode.orchestrator: colocated runs decode's engine in E/P/D's orchestrator; it needs stages.prefill"),
    ({"serve": ["E/P/D"], "stages": {"encoder": {}, "prefill": {"orchestrator": "colocated"}, "decode": {}, "epd": {}}},
     "stages: epd not used by serve ['E/P/D'] (uses decode, encoder, prefill) (prefill.orchestrator is colocated"),
    ({"serve": ["E/P/D"], "stages": {"encoder": {}, "prefill": {"orchestrator": "beside"}, "decode": {}, "epd": {}}},
     "stages.prefill.orchestrator: expected one of proxy, colocated"),
    ({"serve": ["E+PD"], "stages": {"encoder": {}, "pd": {}, "prefill": {"orchestrator": "colocated"}, "epd": {}}},
     "stages: prefill not used by serve"),
    ({"serve": ["E/P/D"], "stages": {"encoder": {}, "pd": {"orchestrator": "colocated"}}}, "stages: pd not used by serve"),
    ({"serve": ["baseline"], "stages": {"llm": {"endpoint": "h:1"}}}, "stages.llm.endpoint: only encoder, pd, prefill, decode"),
    ({"stages": {"encoder": {}, "pd": {"endpoint": "a:1,b"}, "epd": {}}}, "stages.pd.endpoint: expected 'local' or host:port"),
    ({"stages": {"encoder": {"endpoint": "a:1,a:1"}, "pd": {}, "epd": {}}}, "stages.encoder.endpoint: a:1 listed more than once"),
    ({"stages": {"encoder": {}, "pd": {"endpoint": "h"}, "epd": {}}}, "stages.pd.endpoint: expected 'local' or host:port, got 'h'"),
    ({"stages": {"encoder": {}, "pd": {"endpoint": 9001}, "epd": {}}}, "stages.pd.endpoint: expected 'local' or host:port, got '9001'"),
    ({"stages": {"encoder": {}, "pd": {"orchestrator": "colocated", "endpoint": "h:1"}}}, "stages.pd.endpoint: this stage runs inside"),
    ({"stages": {"encoder": {"video_decoder": "nvdec"}, "pd": {}, "epd": {}}},
     "stages.encoder.video_decoder: nvdec works on the encoder's GPU: it needs device: gpu"),
    ({"stages": {"encoder": {"video_decoder": "gpu"}, "pd": {}, "epd": {}}},
     "stages.encoder.video_decoder: expected one of cpu, nvdec, got 'gpu'"),
    ({"stages": {"encoder": {}, "pd": {"video_decoder": "cpu"}, "epd": {}}}, "stages.pd.video_decoder: only the encoder"),
    ({"tier": 5}, "tier: expected a mapping with bytes"),
    ({"tier": {"budget": 5}}, "tier: unknown key(s) budget"),
    ({"tier": {"bytes": 0}}, "tier.bytes: expected a positive number"),
    ({"tier": {"bytes": 1.5}}, "tier.bytes: expected an integer"),
    ({"tier": {"bytes": 1, "claim_seconds": -1}}, "tier.claim_seconds: expected a positive number"),
    ({"tier": {"bytes": 1, "master": "h:1"}}, "tier: master and metadata go together"),
    ({"serve": ["baseline"], "stages": {"llm": {}}, "tier": {"bytes": 1}}, "tier: no deployment served has an encoder"),
])
def test_invalid_topologies_are_refused_with_the_reason(tmp_path, change, fragment):
    doc = {**BASE, **change}
    with pytest.raises(TopologyError) as info:
        load(_write(tmp_path, doc), "cpu")
    assert fragment in str(info.value)


def test_checkpoint_topologies_render_for_a_checkpoint_directory(tmp_path):
    checkpoint = tmp_path / "Qwen2-VL-2B-Instruct"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    gpu = load(ROOT / "topologies" / "checkpoint-gpu.yaml", "gpu", checkpoint)
    assert gpu.checkpoint == checkpoint.resolve() and gpu.models() == {
        "llm": "llm", "encoder": "encoder", "pd": "pd", "prefill": "prefill", "decode": "decode", "epd": "epd:E+PD",
        "epd_disagg": "epd:E/P/D"}
    files = render_files(gpu, tmp_path / "repo")
    args = json.loads(files["pd/model.json"])
    assert (tmp_path / "repo" / "pd" / args["model"]).resolve() == checkpoint.resolve()
    assert args["kv_cache_memory_bytes"] == 16 << 30 and args["dtype"] == "bfloat16" and "distributed_executor_backend" not in args
    assert json.loads(files["decode/model.json"])["kv_cache_memory_bytes"] == 16 << 30  # each engine its own budget
    assert "kind: KIND_GPU gpus: [ 0 ]" in files["encoder/config.pbtxt"]
    # compiled engines (enforce_eager false): the GPU encoder compiles its blocks; an eager rendering does not
    assert 'key: "encoder_compile" value: { string_value: "true" }' in files["encoder/config.pbtxt"]
    eager = render_files(gpu.only(("E+PD",), {"enforce_eager": True}), tmp_path / "eager")
    assert "encoder_compile" not in eager["encoder/config.pbtxt"]
    assert 'key: "encoder_dtype" value: { string_value: "bfloat16" }' in files["encoder/config.pbtxt"]
    cpu = render_files(load(ROOT / "topologies" / "checkpoint-cpu.yaml", "cpu", checkpoint), tmp_path / "repo")
    assert json.loads(cpu["llm/model.json"])["max_model_len"] == 16384
    assert 'key: "encoder_dtype" value: { string_value: "float32" }' in cpu["encoder/config.pbtxt"]
    with pytest.raises(TopologyError, match="not a checkpoint directory"):
        load(ROOT / "topologies" / "checkpoint-cpu.yaml", "cpu", tmp_path / "missing")


def test_every_rendered_file_says_it_is_generated_and_from_what():
    files = render_files(load(DEFAULT, "cpu"), ROOT / "model_repository")
    line = "Generated by backend.deploy.render from topologies/default.yaml: edit the topology and render again"
    assert files and all(line in text for text in files.values()), [f for f, t in files.items() if line not in t]
    assert json.loads(files["pd/model.json"])["_generated"].startswith(line)
    assert "_generated" not in load_engine_args(ROOT / "model_repository" / "pd" / "model.json")  # a note, not an argument


def test_the_tier_renders_into_the_encoder_only_where_the_topology_has_one(tmp_path):
    """The default topology has no tier (its committed rendering stays as it is); a ``tier:`` block becomes the
    encoder's ``tier_*`` parameters, which the launcher reads back (``tier_service.tier_parameters``)."""
    from backend.deploy.render import render
    from backend.deploy.tier_service import launch_for, tier_parameters

    assert "tier_" not in render_files(load(DEFAULT, "cpu"), Path("/r"))["encoder/config.pbtxt"]
    assert load(DEFAULT, "cpu").tier == {}
    render(load(ROOT / "topologies" / "cpu-e-pd-tier.yaml", "cpu"), tmp_path / "tier")
    assert tier_parameters(tmp_path / "tier") == {
        "tier_bytes": "268435456", "tier_master": "", "tier_metadata": "", "tier_call_timeout_seconds": "1.0",
        "tier_retry_seconds": "10.0", "tier_claim_seconds": "5.0"}
    render(load(DEFAULT, "cpu"), tmp_path / "default")
    assert tier_parameters(tmp_path / "default") == {} and launch_for(tmp_path / "default") is None
    assert tier_parameters(tmp_path / "nothing") == {}
    doc = {**BASE, "tier": {"bytes": 1 << 20, "master": "10.0.0.2:50051", "metadata": "http://10.0.0.2:8080/metadata"}}
    render(load(_write(tmp_path, doc), "cpu"), tmp_path / "remote")
    assert launch_for(tmp_path / "remote") is None  # a tier run elsewhere: nothing to start here


def test_the_reuse_block_renders_copies_into_the_consumers_and_demand_aware_into_the_orchestrators():
    """``reuse``: the consumers' copies (pd; the colocated E/P/D orchestrator, whose engine is prefill's) and
    demand-aware encoding at both orchestrators; decode and the baseline get none of it; no block: nothing."""
    files = render_files(load(ROOT / "topologies" / "cpu-reuse.yaml", "cpu"), Path("/r"))
    held = ('key: "held_bytes" value: { string_value: "16777216" }', 'key: "session_seconds" value: { string_value: "60" }')
    demand = 'key: "demand_aware" value: { string_value: "true" }'
    for model in ("pd", "epd_disagg"):
        assert all(line in files[f"{model}/config.pbtxt"] for line in held), model
    assert demand in files["epd/config.pbtxt"] and demand in files["epd_disagg/config.pbtxt"]
    assert "held_bytes" not in files["epd/config.pbtxt"] and "demand_aware" not in files["pd/config.pbtxt"]
    for model in ("llm", "decode", "encoder"):
        assert "held_bytes" not in files[f"{model}/config.pbtxt"] and "demand_aware" not in files[f"{model}/config.pbtxt"]
    assert not any("held_bytes" in text or "demand_aware" in text for text in render_files(load(DEFAULT, "cpu"), Path("/r")).values())


@pytest.mark.parametrize("reuse, stages, message", [
    ({"held": 1}, {}, "unknown key"),
    ({"held_bytes": -1}, {}, "reuse.held_bytes: expected a byte count >= 0"),
    ({"held_bytes": 1.5}, {}, "reuse.held_bytes: expected a byte count"),
    ({"session_seconds": "60"}, {}, "reuse.session_seconds: expected a number"),
    ({"held_bytes": 1, "demand_aware": "yes"}, {}, "reuse.demand_aware: expected true or false"),
    ({"demand_aware": True}, {}, "the consumers keep no copies to find"),
    ({"held_bytes": 1 << 20, "demand_aware": True}, {"pd": {"instances": 2}},
     "E\\+PD's proxy orchestrator cannot know which of stages.pd's 2 instances"),
])
def test_a_bad_reuse_block_is_refused_naming_the_key(tmp_path, reuse, stages, message):
    doc = {**BASE, "stages": {**BASE["stages"], **stages}, "reuse": reuse}
    with pytest.raises(TopologyError, match=message):
        load(_write(tmp_path, doc), "cpu")


def test_demand_aware_with_several_consumer_instances_is_fine_for_the_colocated_orchestrator(tmp_path):
    doc = {**BASE, "stages": {"encoder": {}, "pd": {"instances": 2, "orchestrator": "colocated"}},
           "reuse": {"held_bytes": 1 << 20, "demand_aware": True}}
    assert load(_write(tmp_path, doc), "cpu").reuse["demand_aware"] is True


def test_the_admission_block_renders_budgets_into_the_orchestrators_and_priority_levels_everywhere(tmp_path):
    doc = {**BASE, "serve": ["baseline", "E+PD", "E/P/D"],
           "stages": {"encoder": {}, "pd": {}, "prefill": {}, "decode": {}, "llm": {}, "epd": {}},
           "admission": {"priority_levels": 2, "encoder_items_in_flight": 4, "max_queue_ms": 500,
                         "first_token_target_ms": 150, "high_priority_burst_percent": 100}}
    files = render_files(load(_write(tmp_path, doc), "cpu"), Path("/r"))
    for model in ("epd", "epd_disagg"):
        for line in ('key: "encoder_items_in_flight" value: { string_value: "4" }',
                     'key: "max_queue_ms" value: { string_value: "500" }',
                     'key: "first_token_target_ms" value: { string_value: "150" }',
                     'key: "high_priority_burst_percent" value: { string_value: "100" }',
                     'key: "priority_levels" value: { string_value: "2" }'):
            assert line in files[f"{model}/config.pbtxt"], (model, line)
    for model in ("llm", "pd", "prefill", "decode"):
        text = files[f"{model}/config.pbtxt"]
        assert 'key: "priority_levels" value: { string_value: "2" }' in text and "in_flight" not in text, model
        assert '"scheduling_policy": "priority"' in files[f"{model}/model.json"]  # the engines order by priority
    encoder = files["encoder/config.pbtxt"]  # Triton's own queues per class, the deadline honoured there
    assert 'key: "priority_levels"' not in encoder and "  priority_levels: 2\n  default_priority_level: 2\n" in encoder
    assert ("default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 300000000 "
            "allow_timeout_override: true }") in encoder
    default = render_files(load(DEFAULT, "cpu"), Path("/r"))
    assert not any("in_flight" in text for text in default.values())
    # no admission block: one queue and no policy (Triton's batcher then prefetches: no 500 ms idle waits)
    assert "dynamic_batching {\n  max_queue_delay_microseconds: 2000\n}\n" in default["encoder/config.pbtxt"]
    # encoder_queue: fifo keeps the budgets and the engines' priorities, and the encoder's single queue
    fifo = render_files(load(_write(tmp_path, {**doc, "admission": {**doc["admission"], "encoder_queue": "fifo"}}),
                             "cpu"), Path("/r"))
    assert "dynamic_batching {\n  max_queue_delay_microseconds: 2000\n}\n" in fifo["encoder/config.pbtxt"]
    assert "priority_levels" not in fifo["encoder/config.pbtxt"]
    assert fifo["epd/config.pbtxt"] == files["epd/config.pbtxt"] and "encoder_queue" not in fifo["epd/config.pbtxt"]


@pytest.mark.parametrize("admission, message", [
    ({"budget": 1}, "unknown key"),
    ({"priority_levels": 0}, "admission.priority_levels: expected an integer from 1 to 64"),
    ({"encoder_items_in_flight": -1}, "admission.encoder_items_in_flight: expected an integer >= 0"),
    ({"decode_requests_in_flight": 1.5}, "admission.decode_requests_in_flight: expected an integer >= 0"),
    ({"max_queue_ms": "1s"}, "admission.max_queue_ms: expected a number of ms >= 0"),
    ({"first_token_target_ms": -5}, "admission.first_token_target_ms: expected a number of ms >= 0"),
    ({"encoder_queue": "lifo"}, "admission.encoder_queue: expected one of priority, fifo"),
    ({"high_priority_burst_percent": 500}, "admission.high_priority_burst_percent: expected a percentage from 0 to 400"),
    ([1], "admission: expected a mapping"),
])
def test_a_bad_admission_block_is_refused_naming_the_key(tmp_path, admission, message):
    with pytest.raises(TopologyError, match=message):
        load(_write(tmp_path, {**BASE, "admission": admission}), "cpu")


def test_engine_nice_renders_into_every_engine_model_and_nothing_else(tmp_path):
    doc = {**BASE, "serve": ["baseline", "E+PD", "E/P/D"], "engine_nice": 10,
           "stages": {"encoder": {}, "pd": {}, "prefill": {"orchestrator": "colocated"}, "decode": {}, "llm": {}, "epd": {}}}
    files = render_files(load(_write(tmp_path, doc), "cpu"), Path("/r"))
    nice = 'key: "engine_nice" value: { string_value: "10" }'
    assert sorted(m.split("/")[0] for m, text in files.items() if nice in text) == ["decode", "epd_disagg", "llm", "pd"]
    assert {"encoder/config.pbtxt", "epd/config.pbtxt"} <= set(files)  # rendered, without it (epd_disagg: prefill's engine)
    assert not any("engine_nice" in text for text in render_files(load(DEFAULT, "cpu"), Path("/r")).values())


@pytest.mark.parametrize("nice", [-1, 20, 2.5, True, "10"])
def test_a_bad_engine_nice_is_refused_naming_the_key(tmp_path, nice):
    with pytest.raises(TopologyError, match=r"engine_nice: expected an integer from 0 \(as the server\) to 19, got"):
        load(_write(tmp_path, {**BASE, "engine_nice": nice}), "cpu")


def test_a_rendered_model_copied_under_another_name_is_renamed_and_nothing_else(tmp_path):
    from backend.deploy.render import copy_model, render

    render(load(DEFAULT, "cpu"), tmp_path / "repo")
    config = copy_model(tmp_path / "repo", "encoder", tmp_path / "repo", "encoder_b")
    original = (tmp_path / "repo" / "encoder" / "config.pbtxt").read_text()
    assert config.read_text() == original.replace('name: "encoder"', 'name: "encoder_b"') != original
    assert (tmp_path / "repo" / "encoder_b" / "1" / "model.py").read_text() == \
        (tmp_path / "repo" / "encoder" / "1" / "model.py").read_text()
    (tmp_path / "repo" / "pd" / "config.pbtxt").write_text("no name line\n")
    with pytest.raises(ValueError, match='no name: "pd" line'):
        copy_model(tmp_path / "repo", "pd", tmp_path / "other", "pd_b")


def test_rendering_again_leaves_a_repository_that_holds_the_same_files_alone(tmp_path):
    """A second launcher of the same topology (another server on other ports) must not empty the folder the first
    server's stubs load from; a rendering with other contents swaps the folder whole, stale files gone."""
    from backend.deploy.render import write_files

    out = tmp_path / "repo"
    write_files(out, {"a/config.pbtxt": "one", "a/1/model.py": "m"})
    cached = out / "a" / "1" / "__pycache__" / "model.pyc"  # what Python writes beside a served model.py
    cached.parent.mkdir()
    cached.write_text("bytecode")
    before = (out / "a" / "config.pbtxt").stat().st_mtime_ns
    write_files(out, {"a/config.pbtxt": "one", "a/1/model.py": "m"})
    assert cached.exists() and (out / "a" / "config.pbtxt").stat().st_mtime_ns == before
    write_files(out, {"a/config.pbtxt": "two", "b/config.pbtxt": "b"})
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["a/config.pbtxt", "b/config.pbtxt"] and (out / "a" / "config.pbtxt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # nothing left beside it
