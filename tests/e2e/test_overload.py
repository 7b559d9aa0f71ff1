"""E2E, one server (``topologies/cpu-overload.yaml``'s E+PD, one engine of one sequence, pd's budget one request):
priorities, deadlines and admission by budget through a real tritonserver (docs/interface.md, "Priority, deadlines
and admission"):
- vLLM's priority scheduling at an engine (``pd``, asked directly with text) and the orchestrator's queue for pd
  (``epd``): a high-priority request sent after queued low ones is answered before them;
- a deadline stops the work at each stage, counted: before the orchestrator encodes (nothing encoded), at the encoder
  (``epd_encoder_deadline_stops_total``), in an engine (the request aborted: the engine takes the next request at once);
- a request that cannot start before its deadline is refused at once with the stage and its budget named, and counted;
- a priority or deadline that is not a number in range is INVALID_ARG naming the parameter."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol import errors
from backend.protocol.generate import ENCODER_ITEM, ENCODER_KEY, ENCODER_MODALITY, ERROR_CODES_PARAMETER, GenerateInputs
from clients.triton_client import GenerateError, generate
from tests.e2e.conftest import metric
from tests.images import image_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.solo]  # timing-bound: priority order, shed latency (ModuleLocks)

LONG = {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True}  # seconds of decoding on the tiny model
SHORT = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    topology = load(ROOT / "topologies" / "cpu-overload.yaml", "cpu")
    topology = topology.only("E+PD", engine_args={"max_num_seqs": 1}, engine_nice=1,
                             admission={**topology.admission, "generator_requests_in_flight": 1, "max_queue_ms": 20000,
                                        "high_priority_burst_percent": 0})  # the high class queues at the gate too
    repo = tmp_path_factory.mktemp("overload") / "repo"
    render(topology, repo)
    with TritonServer(repo, log_path=repo.parent / "server.log") as srv:
        yield srv


def ask(server, model, sampling, parameters=None, image=False, **kwargs):
    """One request; its error (if any) with the error envelope (``epd_error_codes``): ``failure`` reads it."""
    inputs = GenerateInputs(prompt="Describe", images=[image_bytes(64, 48)] if image else [], sampling=sampling,
                            parameters={ERROR_CODES_PARAMETER: True, **(parameters or {})})
    return generate(server.grpc_url, model, inputs, **kwargs)


def failure(info) -> errors.EpdError:
    """The domain error a ``GenerateError`` carries (gRPC stream errors have no code: the envelope says it)."""
    return errors.decode(info.value.message)


def counted(server, name: str, **labels) -> float:
    """``metric``, 0 for a series not made yet (the admission counters are made when first counted)."""
    try:
        return metric(server, name, wait_s=0, **labels)
    except AssertionError:
        return 0.0


def settled(read, want, seconds: float = 5.0):
    """``read()`` once it equals ``want`` (counters come in batches), or its last value."""
    deadline = time.time() + seconds
    while (value := read()) != want and time.time() < deadline:
        time.sleep(0.2)
    return value


def in_background(call) -> dict:
    """``call()`` on a thread; the dict gets its result or error and the time it ended."""
    out: dict = {}

    def run():
        out["started"] = time.perf_counter()
        try:
            out["result"] = call()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        out["ended"] = time.perf_counter()
    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


@pytest.mark.parametrize("model", ["pd", "epd"])
def test_a_high_priority_request_is_answered_before_low_ones_queued_earlier(server, model):
    """pd: vLLM's own priority scheduling (one sequence at a time); epd: the orchestrator's queue for pd (budget 1).
    The scenario needs the first request still running when the high one is sent; on a starved machine (the suite's
    other worker) it may end first, and then the scenario is set up once more (at most twice in all)."""
    for _ in range(2):
        first, low, high = _one_behind_another(server, model)
        if high["started"] < first["ended"]:
            break
    assert high["started"] < first["ended"], "the first request ended before the high one was sent, twice"
    assert first["ended"] < high["ended"] < min(call["ended"] for call in low), \
        "the high-priority request waited for the low ones"


def _one_behind_another(server, model):
    """A long first request (priority 1), two low ones (1) queued behind it, then a high one (0)."""
    started = threading.Event()
    first = in_background(lambda: ask(server, model, {**SHORT, "max_tokens": 3000, "ignore_eos": True}, {"epd_priority": 1},
                                      on_text=lambda _: started.set()))
    assert started.wait(60)
    image = model == "epd"  # pd takes layouts, not media: text only
    # the low ones decode for a while: served after the high one, they end well after it, whatever delays the client
    # threads see (a starved client records ends in bursts)
    low = [in_background(lambda: ask(server, model, {**SHORT, "max_tokens": 80, "ignore_eos": True}, {"epd_priority": 1},
                                     image=image)) for _ in range(2)]
    time.sleep(0.3)  # both queued before the high one
    high = in_background(lambda: ask(server, model, SHORT, {"epd_priority": 0}, image=image))
    for call in (first, *low, high):
        call["thread"].join(120)
        assert "error" not in call, call.get("error")
    return first, low, high


def test_a_request_past_its_deadline_is_answered_before_any_encode(server):
    encoded = metric(server, "epd_encoder_items_total")
    finished = metric(server, "epd_requests_total", model="epd", outcome="deadline")
    with pytest.raises(GenerateError) as info:
        ask(server, "epd", SHORT, {"deadline_ms": 0.001}, image=True)
    error = failure(info)
    assert isinstance(error, errors.DeadlineExceeded) and str(error).startswith("request: "), str(error)
    assert settled(lambda: metric(server, "epd_requests_total", model="epd", outcome="deadline"), finished + 1) == \
        finished + 1
    time.sleep(1.5)  # the encoder's metrics are refreshed every second
    assert metric(server, "epd_encoder_items_total") == encoded


def encoder_inputs():
    from tritonclient.grpc import InferInput

    inputs = []
    for name, value in ((ENCODER_ITEM.name, image_bytes(64, 48)), (ENCODER_KEY.name, b""), (ENCODER_MODALITY.name, b"image")):
        inputs.append(InferInput(name, [1, 1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([[value]], dtype=np.object_))
    return inputs


def test_the_encoder_refuses_a_request_whose_deadline_passed(server):
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    before = metric(server, "epd_encoder_deadline_stops_total")
    inputs = encoder_inputs()
    with InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="request: the deadline passed before the encoder started it"):
            client.infer("encoder", inputs, parameters={"epd_deadline": f"{time.time() - 1:.3f}"})
    assert settled(lambda: metric(server, "epd_encoder_deadline_stops_total"), before + 1) == before + 1


def test_the_encoder_s_queue_takes_triton_s_priority_levels_and_rejects_a_request_whose_timeout_passed_there(server):
    """What the orchestrators send a remote encoder (``stage_client.queue_terms``): Triton's priority level and the time
    left as the request's timeout; the rendered batcher (2 levels, timeouts honoured) takes both, and a request whose
    timeout passes while it waits behind a long video in the encoder's queue is rejected there, never encoded."""
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    from tests.videos import make_video

    video = encoder_inputs()
    video[0].set_data_from_numpy(np.array([[make_video(640, 480, frames=120, fps=30.0)]], dtype=np.object_))
    video[2].set_data_from_numpy(np.array([[b"video"]], dtype=np.object_))
    items = lambda: metric(server, "epd_encoder_items_total", model="encoder")
    before = items()
    with InferenceServerClient(server.grpc_url) as client:
        for level in (1, 2):
            assert client.infer("encoder", encoder_inputs(), priority=level, timeout=10_000_000).as_numpy("layout").size == 1
        before = settled(items, before + 2)  # counted (in batches): the next count is the video's alone
        busy = in_background(lambda: client.infer("encoder", video, priority=2))
        time.sleep(0.05)  # the video is being decoded: the next request waits in the queue
        with pytest.raises(InferenceServerException) as info:
            client.infer("encoder", encoder_inputs(), priority=1, timeout=1000)
        busy["thread"].join(60)
    # Triton's own words, which stage_client.QUEUE_TIMEOUT reads as the deadline (tests/unit/triton/test_stage_client.py)
    assert "Request timeout expired" in info.value.message() and "error" not in busy
    assert settled(items, before + 1) == before + 1


@pytest.mark.parametrize("model", ["pd", "epd"])
def test_a_deadline_while_the_engine_decodes_stops_it_there(server, model):
    """The engine (one sequence) is free again at once: the next request's first text comes in well under the
    seconds the expired request still had to decode."""
    engine = "pd"

    def stopped():  # pd stops by its own deadline or by the orchestrator's cancel, whichever comes first
        return metric(server, "epd_requests_total", model=engine, outcome="deadline") + \
            metric(server, "epd_requests_total", model=engine, outcome="cancelled")
    before = stopped()
    started = time.perf_counter()
    with pytest.raises(GenerateError) as info:
        ask(server, model, LONG, {"deadline_ms": 1500})
    assert isinstance(failure(info), errors.DeadlineExceeded) and time.perf_counter() - started < 10
    after = ask(server, model, SHORT)
    assert after.ttft < 2.0, after.ttft
    assert settled(stopped, before + 1) == before + 1


def test_a_request_that_cannot_start_in_time_is_refused_at_once_naming_the_stage_and_its_budget(server):
    ask(server, "epd", {**SHORT, "max_tokens": 100, "ignore_eos": True})  # pd's time in the gate, learnt
    shed = counted(server, "epd_admission_total", model="epd", stage="pd", outcome="shed_budget")
    started = threading.Event()
    busy = in_background(lambda: ask(server, "epd", {**SHORT, "max_tokens": 300, "ignore_eos": True},
                                     on_text=lambda _: started.set()))
    assert started.wait(60)
    queued = in_background(lambda: ask(server, "epd", SHORT))
    time.sleep(0.2)
    sent = time.perf_counter()
    with pytest.raises(GenerateError) as info:
        ask(server, "epd", SHORT, {"deadline_ms": 50})
    answered = time.perf_counter() - sent
    error = failure(info)
    assert isinstance(error, errors.Overloaded) and error.retry_after > 0.05
    assert "overloaded: stage pd is at its budget (1 in flight)" in str(error), str(error)
    assert answered < 1.0, answered
    for call in (busy, queued):
        call["thread"].join(120)
        assert "error" not in call, call.get("error")
    assert settled(lambda: counted(server, "epd_admission_total", model="epd", stage="pd", outcome="shed_budget"),
                   shed + 1) == shed + 1


@pytest.mark.parametrize("model", ["pd", "epd"])
@pytest.mark.parametrize("parameters, field", [
    ({"epd_priority": -1}, "parameters.epd_priority"), ({"epd_priority": "high"}, "parameters.epd_priority"),
    ({"epd_priority": 2}, "parameters.epd_priority"), ({"deadline_ms": "soon"}, "parameters.deadline_ms"),
    ({"deadline_ms": -5}, "parameters.deadline_ms"),
])
def test_a_bad_priority_or_deadline_is_invalid_arg_naming_it(server, model, parameters, field):
    with pytest.raises(GenerateError) as info:
        ask(server, model, SHORT, parameters)
    error = failure(info)
    assert isinstance(error, errors.InvalidInput) and error.field == field, str(error)
    assert ask(server, model, SHORT).text  # still serving


def test_the_engine_core_runs_at_the_topology_s_niceness_and_the_request_path_does_not(server):
    """The fixture's engine_nice is 1, not the topology's 10: the ordering tests above need an engine that reads its
    queue at once even while other work fills the 2 cores."""
    import psutil

    tree = psutil.Process(server.proc.pid).children(recursive=True)
    cores = [p for p in tree if "EngineCore" in p.name()]
    assert len(cores) == 1  # pd's
    assert {t.id: psutil.Process(t.id).nice() for t in cores[0].threads()} == {t.id: 1 for t in cores[0].threads()}
    assert psutil.Process(server.proc.pid).nice() == 0
    assert all(p.nice() == 0 for p in tree if p not in cores and cores[0] not in p.parents())
