"""The BLS half of the orchestrators' stage client (``backend.triton.stage_client.BlsEncoders``, and ``triton_stages``
without remote encoders) over the fake pb_utils: the encoder request it builds and how it reads the answer; the routing's
log lines go to Triton's log."""
import asyncio
import json

import numpy as np
import pytest

from backend.protocol.errors import InvalidInput, Unavailable
from backend.request.generate import MediaBytes
from backend.triton.io import to_triton_error
from backend.triton.stage_client import BlsEncoders, TritonLogger, triton_stages


def encoder_answering(pb, layout: str = '{"layout": 1}', error=None):
    """A BLS ``encoder`` that answers each request with ``layout`` (or ``error``, a domain error) and records it."""
    def handler(request):
        if error is not None:
            return pb.InferenceResponse(error=to_triton_error(error, "epd_error_codes" in request.parameters()))
        key = pb.get_input_tensor_by_name(request, "content_key").as_numpy()
        return pb.InferenceResponse([pb.Tensor("layout", np.array([[layout.encode()]] * key.shape[0], dtype=np.object_))])
    pb.serve("encoder", handler)


def encode(client, item=MediaBytes(b"\x89PNG", "image[0]", "image"), key="k1", part=None):
    return asyncio.run(client.encode(item, key, part))


def test_an_item_is_one_bls_request_of_one_row(pb):
    encoder_answering(pb)
    assert encode(BlsEncoders()) == '{"layout": 1}'
    (request,) = pb.bls_requests
    assert request.model_name == "encoder" and request.requested_output_names() == ["layout"]
    tensors = {t.name(): t.as_numpy() for t in request.inputs()}
    assert {name: a.shape for name, a in tensors.items()} == {"image": (1, 1), "content_key": (1, 1), "modality": (1, 1)}
    assert (tensors["image"][0, 0], tensors["content_key"][0, 0], tensors["modality"][0, 0]) == (b"\x89PNG", b"k1", b"image")
    assert json.loads(request.parameters()) == {"epd_error_codes": True}  # the stage tags its errors with their code


def test_a_video_part_and_media_options_travel_as_parameters(pb):
    encoder_answering(pb)
    video = MediaBytes(b"\x00\x00\x00\x18ftyp", "video[0]", "video", options='{"num_frames":4}')
    encode(BlsEncoders("encoder"), video, "k2", part=(1, 3))
    params = json.loads(pb.bls_requests[0].parameters())
    assert params["epd_part"] == "1/3" and json.loads(params["media_io_kwargs"]) == {"video": {"num_frames": 4}}


@pytest.mark.parametrize("error", [InvalidInput("image", "cannot identify image file"),
                                   Unavailable("embedding pool full")])
def test_the_encoders_error_comes_back_as_its_domain_error(pb, error):
    encoder_answering(pb, error=error)
    with pytest.raises(type(error)) as caught:
        encode(BlsEncoders())
    assert str(caught.value) == str(error)


def test_an_encoder_that_is_not_loaded_is_unavailable_naming_it(pb):
    with pytest.raises(Unavailable, match="encoder"):
        encode(BlsEncoders())


def test_triton_stages_encode_over_bls_without_remote_encoders(pb):
    encoder_answering(pb, layout='{"layout": 2}')
    stages = triton_stages({}, encoder_model="encoder", encoders=None)
    assert encode(stages) == '{"layout": 2}' and len(pb.bls_requests) == 1
    assert isinstance(stages.logger, TritonLogger)


def test_the_routing_logs_to_the_triton_log(pb):
    TritonLogger.info("stage pd answers at localhost:8001")
    TritonLogger.warning("stage pd at localhost:8001 was lost")
    assert pb.logged == [("INFO", "stage pd answers at localhost:8001"), ("WARNING", "stage pd at localhost:8001 was lost")]


def test_a_remote_encoder_request_carries_its_priority_level_and_the_time_left_as_triton_s_terms():
    import time

    from backend.protocol.errors import DeadlineExceeded
    from backend.triton.stage_client import queue_terms
    from orchestrator.admission import Urgency

    assert queue_terms(Urgency()) == {"priority": 1}  # Triton's level 1: epd_priority 0, served first
    terms = queue_terms(Urgency(2, time.time() + 1.5))
    assert terms["priority"] == 3 and 1.3e6 < terms["timeout"] <= 1.5e6  # microseconds to the deadline
    with pytest.raises(DeadlineExceeded, match="before the item was sent to the encoder"):
        queue_terms(Urgency(0, time.time() - 0.01))


class _TritonError:
    def __init__(self, message, status):
        self._message, self._status = message, status

    def message(self):
        return self._message

    def status(self):
        return self._status


def test_a_request_whose_deadline_passed_in_the_encoder_s_queue_is_a_deadline_not_a_lost_replica():
    from backend.protocol.errors import DeadlineExceeded
    from backend.triton.stage_client import _call_failed
    from orchestrator.health import Unreachable

    error = _call_failed("encoder", "h:1", _TritonError("Request timeout expired", "StatusCode.UNAVAILABLE"))
    assert isinstance(error, DeadlineExceeded) and "encoder's queue at h:1" in str(error)
    lost = _call_failed("encoder", "h:1", _TritonError("failed to connect to all addresses", "StatusCode.UNAVAILABLE"))
    assert isinstance(lost, Unreachable) and lost.lost


def test_a_stream_call_cancelled_under_the_request_is_unreachable_and_a_cancel_of_the_request_stays_one():
    """grpc.aio raises ``CancelledError`` from a call its closed channel cancelled (a lost replica's, or a demand-aware
    lookup's on it): the call failed, UNAVAILABLE naming the stage; the request's own task cancelled still cancels."""
    from backend.triton.stage_client import _unavailable_if_unreachable
    from orchestrator.health import Unreachable

    class CancelledStream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise asyncio.CancelledError

    async def read():
        return [item async for item in _unavailable_if_unreachable(CancelledStream(), "pd", "10.0.0.5:8001")]

    with pytest.raises(Unreachable, match="stage pd at 10.0.0.5:8001: the call was cancelled"):
        asyncio.run(read())

    class Waiting(CancelledStream):
        async def __anext__(self):
            await asyncio.sleep(10)

    async def cancelled_reader():
        task = asyncio.ensure_future(anext(_unavailable_if_unreachable(Waiting(), "pd", "10.0.0.5:8001")))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):  # not Unreachable: the request's own cancel
        asyncio.run(cancelled_reader())


def test_a_generate_call_cancelled_under_the_request_outside_its_reads_is_unreachable_naming_the_stage(monkeypatch):
    """The same ``CancelledError`` raised where the call sets up its kept stream (not while reading it) is the call's
    failure too, naming the stage and the replica (CI, 2026-12-07: a partitioned pd host's request ended with "a
    stage call was cancelled while generating", naming neither); the request's own cancel still cancels."""
    import contextlib

    from backend.protocol.stages import Stage
    from backend.request.generate import RawGenerateInputs
    from backend.triton.stage_client import GrpcStageCalls
    from orchestrator.health import Unreachable

    class ClosedChannelPool:
        @contextlib.asynccontextmanager
        async def stream(self, request):
            await asyncio.sleep(0)
            raise asyncio.CancelledError  # grpc.aio: the channel closed under the call
            yield

    calls = GrpcStageCalls()
    monkeypatch.setattr(calls, "_client", lambda address: object())
    monkeypatch.setattr(calls, "_pool", lambda address: ClosedChannelPool())

    async def read():
        return [c async for c in calls.generate_at("10.0.0.5:8001", "pd", Stage.PD, RawGenerateInputs(prompt="Hi"), None)]

    with pytest.raises(Unreachable, match="stage pd at 10.0.0.5:8001: the call was cancelled"):
        asyncio.run(read())

    class SlowPool:
        @contextlib.asynccontextmanager
        async def stream(self, request):
            await asyncio.sleep(10)
            yield

    monkeypatch.setattr(calls, "_pool", lambda address: SlowPool())

    async def cancelled_reader():
        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):  # not Unreachable: the request's own cancel
        asyncio.run(cancelled_reader())
