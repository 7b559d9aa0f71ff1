"""The ``llm`` model (``backend.triton.generate_model.GenerateModel``) loaded and driven end to end over the fake
pb_utils. vLLM is faked at its seam, ``EngineHost.start`` (``FakeEngine`` on an event-loop thread), and so is the
checkpoint's processor lookup (``checkpoint_media``, which would import transformers); the Triton side is the real
adapter: config, decoupled check, request reading, streaming, cancels, load probes, metrics, finalize."""
import json
import time
import uuid

import pytest

from backend.engine.loop import LoopThread
from backend.triton import generate_model
from backend.triton.io import TritonSink
from backend.triton.models import llm
from tests.fakes import FakeEngine
from tests.unit.triton.inputs import generate_request, only_error, outputs

FINAL = 1


class FakeHost:
    """``EngineHost`` without vLLM: the engine's generation on a loop thread of its own."""

    def __init__(self, engine: FakeEngine, engine_args: dict):
        self.engine, self.engine_args, self.loop, self.stopped = engine, engine_args, LoopThread("fake-engine"), False

    def submit(self, coro):
        return self.loop.submit(coro)

    def prompt_text(self, request):
        return self.engine.prompt_text(request)

    def generate(self, request, request_id):
        return self.engine.generate(request, request_id)

    async def abort(self, request_id):
        await self.engine.abort(request_id)

    def shutdown(self):
        self.loop.stop()
        self.stopped = True


def model_args(tmp_path, decoupled=True, instances=(1,), parameters=None) -> dict:
    config = {"model_transaction_policy": {"decoupled": decoupled},
              "instance_group": [{"count": n, "kind": "KIND_CPU"} for n in instances],
              "parameters": {k: {"string_value": v} for k, v in (parameters or {"engine_args": "model.json"}).items()}}
    name = f"llm-test-{uuid.uuid4().hex[:8]}"  # its cancel board's directory is this model's own
    return {"model_name": name, "model_config": json.dumps(config), "model_repository": str(tmp_path),
            "model_instance_kind": "CPU", "model_instance_name": f"{name}_0"}


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def load(pb, tmp_path, monkeypatch, engine):
    """``load(**model_args)``: an ``llm`` model initialized on ``engine``; finalized after the test."""
    monkeypatch.setattr(generate_model, "checkpoint_media", lambda model: {"video_processor": "", "audio_sampling_rate": 0})
    engine.may_fork = []  # what each EngineHost.start was told
    monkeypatch.setattr(generate_model.EngineHost, "start", classmethod(
        lambda cls, args, stats_observer=None, beside=None, may_fork=True:
        engine.may_fork.append(may_fork) or FakeHost(engine, args)))
    monkeypatch.setattr(generate_model, "report_a_slow_finalize", lambda: None)  # faulthandler timers: not in pytest
    monkeypatch.setattr(generate_model, "bound_the_exit", lambda: None)
    (tmp_path / "model.json").write_text(json.dumps({"model": str(tmp_path), "limit_mm_per_prompt": {"image": 2}}))
    loaded = []

    def make(**kwargs):
        model = llm.TritonPythonModel()
        model.initialize(model_args(tmp_path, **kwargs))
        loaded.append(model)
        return model
    yield make
    for model in loaded:
        if not model.host.stopped:
            model.finalize()


def answered(sender, seconds: float = 5.0):
    """Wait until the request got its final flag (the engine loop answers after ``execute`` returned)."""
    deadline = time.monotonic() + seconds
    while not sender.closed:
        assert time.monotonic() < deadline, f"no final flag after {seconds} s: {sender.sent}"
        time.sleep(0.005)
    return sender.sent


def test_initialize_reads_the_config_and_model_json(load):
    model = load(instances=(2, 1), parameters={"engine_args": "model.json", "stream_interval_ms": "20"})
    assert model.instances == 3 and model.stream_interval == 0.02
    assert model.limits.max_images == 2 and model.limits.max_videos == 8  # limit_mm_per_prompt, else 8
    assert model.host.engine_args["model"] == model.engine_args["model"]


@pytest.mark.parametrize("agents", [0, 1])
def test_the_engine_may_fork_only_while_the_process_has_no_nixl_agent(load, engine, monkeypatch, agents):
    """A child forked after a NIXL agent shares its UCX state (backend.engine.host.engine_start_method)."""
    monkeypatch.setattr(generate_model, "agents_in_process", lambda: agents)
    load()
    assert engine.may_fork == [not agents]


def test_a_model_that_is_not_decoupled_fails_the_load(load, pb):
    with pytest.raises(pb.TritonModelException, match="decoupled"):
        load(decoupled=False)


def test_a_bad_parameter_fails_the_load(load, pb):
    with pytest.raises(pb.TritonModelException, match="stream_interval_ms"):
        load(parameters={"stream_interval_ms": "soon"})


def test_a_request_streams_to_its_final_response(load, pb):
    model = load()
    request = generate_request(text_input="Say hi", stream=True, sampling_parameters={"max_tokens": 3},
                               return_num_output_tokens=True)
    assert model.execute([request]) is None  # decoupled: everything goes through the sender
    sent = answered(request.get_response_sender())
    assert [flags for _, flags in sent] == [0, 0, FINAL]
    assert [outputs(r)["text_output"] for r, _ in sent] == ["Hel", "lo", "!"]
    assert outputs(sent[-1][0])["finish_reason"] == "stop" and outputs(sent[-1][0])["num_output_tokens"] == 3
    model.metric_batch.flush()
    labels = {"model": model.name, "instance": f"{model.name}_0"}
    assert pb.series("epd_requests_total", **labels, outcome="ok").value == 1
    assert len(pb.series("epd_request_duration_seconds", **labels).observations) == 1


@pytest.mark.parametrize("inputs, field", [({}, "text_input"),
                                           ({"text_input": "a", "sampling_parameters": "{"}, "sampling_parameters"),
                                           ({"text_input": "a", "image": [b"x"] * 3}, "image")])
def test_a_bad_request_is_answered_at_once_with_invalid_arg(load, pb, engine, inputs, field):
    model = load()
    request = generate_request(**inputs)
    model.execute([request])
    error = only_error(request.get_response_sender())  # sent by execute itself, before it returned
    assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith(field)
    assert engine.requests == 0


def test_one_bad_request_does_not_fail_its_batch(load):
    model = load()
    good, bad = generate_request(text_input="a"), generate_request(messages="not json")
    model.execute([bad, good])
    assert only_error(bad.get_response_sender()) and answered(good.get_response_sender())[-1][1] == FINAL


def test_error_codes_are_tagged_when_asked(load):
    model = load()
    request = generate_request(parameters={"epd_error_codes": True})
    model.execute([request])
    assert only_error(request.get_response_sender()).message().startswith("[INVALID_ARG] text_input")


def test_a_load_probe_answers_kv_cache_usage(load):
    model = load()
    probe = generate_request(parameters={"epd_load": True})
    model.execute([probe])
    (response, flags), = probe.get_response_sender().sent
    assert flags == FINAL and json.loads(outputs(response)["text_output"]) == {"kv_cache_usage": None}


def test_a_client_cancel_aborts_the_engine_request(load, engine, monkeypatch):
    monkeypatch.setattr(TritonSink, "CANCEL_CHECK_SECONDS", 0.0)
    engine.pieces, engine.step_delay = ["t"] * 200, 0.01
    model = load()
    request = generate_request(text_input="long", stream=True)
    model.execute([request])
    sender = request.get_response_sender()
    while not sender.sent:
        time.sleep(0.005)
    request.cancel()
    sent = answered(sender)
    assert sent[-1] == (None, FINAL) and len(engine.aborted) == 1 and engine.steps_run < 200


def test_an_in_band_cancel_ends_the_named_request(load, engine, monkeypatch):
    monkeypatch.setattr(TritonSink, "BOARD_CHECK_SECONDS", 0.0)
    engine.pieces, engine.step_delay = ["t"] * 200, 0.01
    model = load()
    running = generate_request(text_input="long", stream=True, request_id="victim")
    model.execute([running])
    canceller = generate_request(parameters={"epd_cancel": "victim"})
    model.execute([canceller])
    assert canceller.get_response_sender().sent == [(None, FINAL)]
    assert answered(running.get_response_sender())[-1] == (None, FINAL) and engine.aborted


def test_finalize_stops_the_engine_and_hands_over_the_metrics(load, pb):
    model = load()
    request = generate_request(text_input="a")
    model.execute([request])
    answered(request.get_response_sender())
    host, name = model.host, model.name
    model.finalize()
    assert host.stopped and not hasattr(model, "metrics")
    assert pb.series("epd_requests_total", model=name, instance=f"{name}_0", outcome="ok").value == 1


def test_decode_in_process_on_an_e_pd_orchestrator_is_refused_before_any_engine_starts(pb, tmp_path, monkeypatch):
    from backend.triton.models import colocated

    started = []
    monkeypatch.setattr(generate_model.EngineHost, "start", lambda *a, **k: started.append(a) or None)
    args = model_args(tmp_path, parameters={"engine_args": "model.json", "topology": "E+PD",
                                            "orchestrator": "colocated", "decode_in_process": "true"})
    with pytest.raises(pb.TritonModelException, match="decode_in_process: only an E/P/D orchestrator has decode"):
        colocated.TritonPythonModel().initialize(args)
    assert started == []
