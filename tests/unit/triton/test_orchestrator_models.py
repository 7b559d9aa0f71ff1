"""The orchestrator models' ``execute`` (``backend.triton.models.epd.orchestrate``) and the ``encoder`` model's, over
the fake pb_utils. ``orchestrate`` drives the real ``Orchestrator``, its encoders over (fake) BLS and its generator
stages faked (``FakeStages``); the encoder's work (``EncoderService``: a tower, a pool) is faked at its seam."""
import asyncio
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import content_key
from backend.request.generate import RequestLimits
from orchestrator.cancel_board import CancelBoard
from backend.triton.io import to_triton_error
from backend.triton.metrics import RequestMetrics
from backend.triton.models import encoder
from backend.triton.io import orchestrate
from backend.triton.stage_client import BlsEncoders
from orchestrator.core import Identity, Orchestrator
from tests.fakes import FakeStages
from tests.unit.triton.inputs import generate_request, only_error, outputs

FINAL = 1


class BlsAndFakeGenerators(BlsEncoders):
    """The ``epd`` model's stage client with its encoders over BLS and its generator stages faked."""

    def __init__(self):
        super().__init__("encoder")
        self.generators = FakeStages(pieces=("a", "b"))

    def generate(self, inputs, stage=None):
        return self.generators.generate(inputs, stage)


def serve_encoder(pb, error=None):
    """An ``encoder`` over BLS answering each item with a layout (JSON) naming its bytes, or failing with ``error``."""
    def answer(request):
        if error is not None:
            return pb.InferenceResponse(error=to_triton_error(error, tag_code=True))
        data = pb.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)[0]
        layout = json.dumps({"layout": data.decode()}).encode()
        return pb.InferenceResponse([pb.Tensor("layout", np.array([[layout]], dtype=np.object_))])
    pb.serve("encoder", answer)


@pytest.fixture
def epd(pb):
    """``execute(requests)`` of an ``epd`` model (its runs awaited in place of its loop) and its stage client."""
    stages = BlsAndFakeGenerators()
    orchestrator = Orchestrator(stages, Identity("qwen2_vl:test", "{}"), RequestLimits(max_images=4))
    metrics = RequestMetrics("epd")
    yield (lambda requests: orchestrate(requests, orchestrator, metrics, asyncio.run, CancelBoard(None))), stages
    metrics.close()


def test_a_request_with_an_image_goes_through_the_encoder_to_the_generator(pb, epd):
    execute, stages = epd
    serve_encoder(pb)
    request = generate_request("epd", text_input="<|image_pad|> what?", image=[b"PIC"], stream=True)
    execute([request])
    (bls,) = pb.bls_requests
    assert bls.model_name == "encoder"
    (sent,) = stages.generators.generated
    assert sent.images == () and sent.image_layouts == ('{"layout": "PIC"}',)  # metadata only reaches the generator
    responses = request.get_response_sender().sent
    assert [(outputs(r)["text_output"], flags) for r, flags in responses] == [("a", 0), ("b", FINAL)]


def test_an_encoder_error_reaches_the_client_with_its_code(pb, epd):
    execute, stages = epd
    serve_encoder(pb, error=InvalidInput("image", "cannot identify image file"))
    request = generate_request("epd", text_input="<|image_pad|>", image=[b"junk"])
    execute([request])
    error = only_error(request.get_response_sender())
    assert error.code() == pb.TritonError.INVALID_ARG and "cannot identify image file" in error.message()
    assert stages.generators.generated == []


@pytest.mark.parametrize("name", ["epd_metadata_only", "epd_encode", "epd_demand_aware"])
def test_a_run_option_that_is_not_a_bool_is_invalid_arg(pb, epd, name):
    execute, stages = epd
    request = generate_request("epd", text_input="hi", parameters={name: "yes"})
    execute([request])
    error = only_error(request.get_response_sender())
    assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith(f"parameters.{name}")
    assert stages.generators.generated == []


def test_an_in_band_cancel_is_answered_and_runs_nothing(pb, epd):
    execute, stages = epd
    request = generate_request("epd", parameters={"epd_cancel": "someone"})
    execute([request])
    assert request.get_response_sender().sent == [(None, FINAL)] and stages.generators.generated == []


class FakeService:
    """``EncoderService.run``'s seam: a layout per job, naming its key; a request's ``fail`` result instead."""

    def __init__(self, fail: dict | None = None):
        self.jobs, self.fail = [], fail or {}

    def run(self, jobs, requests):
        self.jobs = jobs
        results = [[] for _ in range(requests)]
        for job in jobs:
            results[job.request_index].append(f"layout:{job.content_key}")
        return [self.fail.get(i, r) for i, r in enumerate(results)]


def encoder_model(service):
    model = encoder.TritonPythonModel.__new__(encoder.TritonPythonModel)  # execute's state, without a tower or pool
    model.service, model.processing, model.encoder = service, "{}", SimpleNamespace(identity="qwen2_vl:test")
    return model


def rows(pb, name, values):
    return pb.Tensor(name, np.array([[v] for v in values], dtype=np.object_))


class RaisingService(FakeService):
    """A service whose failure was raised and caught inside ``run``, as ``EncoderService``'s are: its traceback's
    frame has ``execute``'s as its caller."""

    def run(self, jobs, requests):
        results = super().run(jobs, requests)
        try:
            raise RuntimeError("the tower failed")
        except RuntimeError as exc:
            results[0] = exc
        return results


@pytest.mark.parametrize("service, parameters", [(FakeService(), {"epd_part": "3/2"}), (RaisingService(), {})],
                         ids=["refused before encoding", "failed in the service"])
def test_a_failed_request_leaves_no_cycle_holding_the_batch(pb, service, parameters, caplog):
    """A failure's traceback reaches ``execute``'s frame, which held it: a cycle keeping every request of the batch
    that only the garbage collector frees; left to the interpreter's end, Triton request objects segfaulted the stub
    (their destructors reach into its shared memory, gone by then). Refcounting alone must free the batch."""
    import gc
    import weakref

    caplog.set_level(logging.CRITICAL)  # pytest keeps each log record (an error's holds its traceback); a stub's
    gc.collect()                          # log handler writes it and drops it
    gc.disable()
    try:
        request = pb.InferenceRequest("encoder", [rows(pb, "image", [b"C"])], ["layout"], parameters=parameters)
        gone = weakref.ref(request)
        responses = encoder_model(service).execute([request])
        assert responses[0].has_error()
        del request, responses
        assert gone() is None
    finally:
        gc.enable()


def test_the_encoder_answers_each_request_of_its_batch(pb):
    service = FakeService(fail={2: RuntimeError("pool full")})
    keyed = pb.InferenceRequest("encoder", [rows(pb, "image", [b"A", b"B"]), rows(pb, "content_key", [b"k1", b"k2"]),
                                            rows(pb, "modality", [b"video", b""])], ["layout"])
    bad_part = pb.InferenceRequest("encoder", [rows(pb, "image", [b"C"])], ["layout"], parameters={"epd_part": "3/2"})
    failing = pb.InferenceRequest("encoder", [rows(pb, "image", [b"D"])], ["layout"],
                                  parameters={"epd_error_codes": True})
    unkeyed = pb.InferenceRequest("encoder", [rows(pb, "image", [b"E"])], ["layout"])
    responses = encoder_model(service).execute([keyed, bad_part, failing, unkeyed])
    assert len(responses) == 4
    layouts = pb.get_output_tensor_by_name(responses[0], "layout").as_numpy()
    assert layouts.shape == (2, 1) and list(layouts.reshape(-1)) == [b"layout:k1", b"layout:k2"]
    assert [job.modality for job in service.jobs[:2]] == ["video", "image"]  # empty: an image
    assert responses[1].error().code() == pb.TritonError.INVALID_ARG
    assert responses[1].error().message().startswith("parameters.epd_part")
    assert responses[2].error().message().startswith("[INTERNAL] ")  # tagged: it asked for error codes
    own = content_key(b"E", "{}", "qwen2_vl:test")  # no key given: computed from the bytes
    assert service.jobs[-1].own_key == own and not responses[3].has_error()
