import json

import pytest
from pathlib import Path

from backend.engine.host import load_engine_args

ROOT = Path(__file__).resolve().parents[2]


def test_relative_paths_resolve_against_the_json_folder(tmp_path):
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.json"
    path.write_text(json.dumps({"model": "../weights", "tokenizer": "org/name", "dtype": "float32"}))
    args = load_engine_args(path)
    assert args["model"] == str(tmp_path / "weights")
    assert args["tokenizer"] == "org/name"  # a hub-style id is left alone
    assert args["dtype"] == "float32"


def test_committed_llm_engine_args_point_at_the_tiny_model():
    args = load_engine_args(ROOT / "model_repository" / "llm" / "model.json")
    assert Path(args["model"]) == ROOT / "models" / "tiny-qwen2-vl"
    assert args["limit_mm_per_prompt"]["image"] >= 1


def test_vllm_errors_map_to_domain_errors():
    exceptions = pytest.importorskip("vllm.exceptions")  # absent on the GPU machine only
    QueueOverflowError, VLLMValidationError = exceptions.QueueOverflowError, exceptions.VLLMValidationError

    from backend.engine.host import _domain_error
    from backend.protocol.errors import ErrorCode
    from backend.request.generate import GenerateRequest

    req = GenerateRequest(prompt=None, conversation=[{"role": "user", "content": "p"}], items=(), sampling={})
    too_long = _domain_error(VLLMValidationError("too long", parameter="input_tokens", value=5000), req)
    assert too_long.code is ErrorCode.INVALID_ARG and too_long.field == "messages"
    bad_param = _domain_error(VLLMValidationError("bad", parameter="max_tokens", value=-1), req)
    assert bad_param.field == "sampling_parameters.max_tokens"
    no_audio = _domain_error(VLLMValidationError("At most 0 audio(s) may be provided in one prompt.", parameter="audio"), req)
    assert no_audio.field == "audio"  # a model without audio, given some
    assert _domain_error(ValueError("bad image"), req).code is ErrorCode.INVALID_ARG
    assert _domain_error(QueueOverflowError(), req).code is ErrorCode.UNAVAILABLE
    other = RuntimeError("boom")
    assert _domain_error(other, req) is other


def test_kv_buffers_live_where_the_engine_runs():
    """NixlConnector's KV buffers: host memory for a CPU instance, device memory for a KIND_GPU one."""
    from backend.engine.host import kv_transfer_config

    assert kv_transfer_config("kv_producer", on_gpu=False) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": 30}}  # vLLM's own default unless the topology says
    assert kv_transfer_config("kv_consumer", on_gpu=True)["kv_buffer_device"] == "cuda"
    assert kv_transfer_config("kv_consumer", False, 6)["kv_connector_extra_config"] == {"kv_lease_duration": 6}


def test_the_kv_lease_is_rendered_for_both_kv_engines_and_checked(tmp_path):
    """``transfer.kv_lease_seconds`` reaches prefill and decode (they must agree: decode renews the lease prefill
    keeps) and the colocated E/P/D host; anything but whole seconds >= 6 is refused naming the key."""
    import dataclasses

    import yaml

    from backend.deploy.render import render_files
    from backend.deploy.topology import TopologyError, load

    topology = load(ROOT / "topologies" / "cpu-e-p-d.yaml", "cpu")
    assert topology.transfer["kv_lease_seconds"] == 30
    files = render_files(dataclasses.replace(topology, transfer={**topology.transfer, "kv_lease_seconds": 8}), tmp_path)
    for model in ("prefill", "decode"):
        assert 'key: "kv_lease_seconds" value: { string_value: "8" }' in files[f"{model}/config.pbtxt"], model
    assert "kv_lease_seconds" not in files["encoder/config.pbtxt"]
    doc = yaml.safe_load((ROOT / "topologies" / "cpu-e-p-d.yaml").read_text())
    for bad in (5, 7.5):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**doc, "checkpoint": str(ROOT / "models" / "tiny-qwen2-vl"),
                                                           "transfer": {**doc["transfer"], "kv_lease_seconds": bad}}))
        with pytest.raises(TopologyError, match="transfer.kv_lease_seconds: expected whole seconds, at least 6"):
            load(tmp_path / "bad.yaml", "cpu")
