"""The colocated orchestrators: ``Orchestrator`` over ``LocalStages`` (encoders and prefill faked, the streamed
stage an in-process engine, ``FakeEngine``), as ``backend.triton.models.colocated`` runs them: E+PD (pd's engine here)
and E/P/D (prefill's engine here, decode remote)."""
import asyncio
import json

import pytest

from backend.protocol.errors import InvalidInput, Unavailable
from backend.request.generate import RawGenerateInputs, RequestLimits
from backend.engine.serving import Outcome
from backend.protocol.stages import Disaggregation, Stage
from orchestrator.core import Identity, Orchestrator
from orchestrator.local_stages import LocalEngine, LocalStages
from tests.fakes import FakeEngine, FakeLayoutResolver, FakePull, FakeSink, FakeStages, RecordingObserver

IDENTITY = Identity("qwen2_vl:test", '{"max_pixels":12544}')
PH = "<|vision_start|><|image_pad|><|vision_end|>"


def colocated(engine=None, pull=None, encoders=None, interval=0.0, local=Stage.PD):
    encoders = encoders or FakeStages()
    stages = LocalStages(encoders, engine or FakeEngine(), FakeLayoutResolver(), RequestLimits(max_images=4),
                         prepare=pull or FakePull(), interval=interval, local=local)
    return stages, encoders


def run(stages, raw, sink=None, observer=None, deadline=0.0):
    sink = sink or FakeSink()
    disaggregation = Disaggregation.E_P_D if stages.local is Stage.PREFILL else Disaggregation.E_PD
    orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(max_images=4), disaggregation, deadline=deadline)
    outcome = asyncio.run(orchestrator.run(raw, sink, observer))
    return outcome, sink


def test_the_engine_gets_the_metadata_only_request_and_its_stream_reaches_the_client():
    pull, observer = FakePull(), RecordingObserver()
    stages, encoders = colocated(pull=pull)
    raw = RawGenerateInputs(prompt=f"{PH}{PH}Compare.", images=(b"A", b"B"), stream=True,
                            return_num_input_tokens=True, return_num_output_tokens=True)
    outcome, sink = run(stages, raw, observer=observer)
    assert outcome is Outcome.OK and len(encoders.encoded) == 2
    [request] = pull.seen  # what the engine side parsed: the encoders' layouts, no media
    assert request.items == ('{"layout": 0}', '{"layout": 1}') and request.original_media == ()
    assert request.prompt == f"{PH}{PH}Compare." and request.stream
    assert [(c.text_output, final) for c, final in sink.chunks] == [("Hel", False), ("lo", False), ("!", True)]
    last = sink.chunks[-1][0]
    assert (last.finish_reason, last.num_input_tokens, last.num_output_tokens) == ("stop", 7, 3)
    timings = last.timings  # the orchestrator's breakdown with the pull's transfer
    assert timings["items"] == 2 and timings["transfer_bytes"] == 128 and timings["transfer_ms"] == 0.5
    assert 0 < timings["encode_ms"] <= timings["total_ms"] and timings["generate_ms"] <= timings["total_ms"]
    assert observer.finished == [(Outcome.OK, 3)] and sink.finals == 1


@pytest.mark.parametrize("exclude, expected", [(False, "Q: Hello!"), (True, "Hello!")])
def test_non_streaming_sends_one_response(exclude, expected):
    stages, _ = colocated()
    _, sink = run(stages, RawGenerateInputs(prompt="Q: ", exclude_input_in_output=exclude))
    assert [(c.text_output, final) for c, final in sink.chunks] == [(expected, True)]


def test_stream_interval_merges_steps():
    stages, _ = colocated(engine=FakeEngine(pieces=list("abcdef"), step_delay=0.01), interval=0.025)
    _, sink = run(stages, RawGenerateInputs(prompt="x", stream=True))
    texts = [c.text_output for c, _ in sink.chunks]
    assert texts[0] == "a" and "".join(texts) == "abcdef" and 2 <= len(texts) < 6


def test_text_only_skips_encoders_and_pull_sees_no_items():
    pull = FakePull()
    stages, encoders = colocated(pull=pull)
    outcome, _ = run(stages, RawGenerateInputs(prompt="hello"))
    assert outcome is Outcome.OK and encoders.encoded == [] and pull.seen[0].items == ()


def test_client_cancel_aborts_the_engine_request():
    engine = FakeEngine(pieces=["t"] * 50)
    stages, _ = colocated(engine=engine)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), FakeSink(cancel_after=2))
    assert outcome is Outcome.CANCELLED and sink.closed == 1 and len(sink.chunks) == 2
    assert len(engine.aborted) == 1 and engine.steps_run < 50


def test_finished_requests_are_not_aborted():
    engine = FakeEngine()
    stages, _ = colocated(engine=engine)
    run(stages, RawGenerateInputs(prompt="x", stream=True))
    assert engine.aborted == []


def test_a_lost_embedding_is_encoded_again_and_nothing_reaches_the_engine_before():
    pull, engine = FakePull(Unavailable("embedding lease 1a expired before it was read", "image_layouts[0]"), 1), FakeEngine()
    stages, encoders = colocated(engine=engine, pull=pull)
    observer = RecordingObserver()
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",)), observer=observer)
    assert outcome is Outcome.OK and observer.retried == ["request"] and len(encoders.encoded) == 2
    assert engine.steps_run == 3 and engine.aborted == []  # one generation: the retry's
    assert sink.chunks[-1][0].timings["retries"] == 1


def test_a_lost_embedding_twice_fails_naming_the_clients_item():
    pull = FakePull(Unavailable("embedding lease 2b expired before it was read", "image_layouts[1]"), 2)
    stages, _ = colocated(pull=pull)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a", b"b")))
    assert outcome is Outcome.ERROR
    [error] = sink.errors
    assert isinstance(error, Unavailable) and str(error) == "image[1]: embedding lease 2b expired before it was read"


def test_an_encoder_error_fails_the_request_under_the_clients_field():
    encoders = FakeStages(encode_error=InvalidInput("image", "cannot decode image"), fail_item=0)
    engine = FakeEngine()
    stages, _ = colocated(engine=engine, encoders=encoders)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"bad",)))
    assert outcome is Outcome.ERROR and str(sink.errors[0]) == "image[0]: cannot decode image"
    assert engine.steps_run == 0


def test_an_engine_error_mid_stream_fails_the_request_and_aborts():
    engine = FakeEngine(fail_with=RuntimeError("engine broke"), fail_after=1)
    stages, _ = colocated(engine=engine)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True))
    assert outcome is Outcome.ERROR and "engine broke" in str(sink.errors[0]) and len(engine.aborted) == 1
    assert sink.finals == 1


def test_deadline_while_generating_aborts_the_engine_request():
    engine = FakeEngine(pieces=["t"] * 100, step_delay=0.01)
    stages, _ = colocated(engine=engine)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), deadline=0.1)
    assert outcome is Outcome.EXPIRED and "deadline of 0.1 s exceeded while generating" in str(sink.errors[0])
    assert len(engine.aborted) == 1 and engine.steps_run < 100


def test_media_given_to_the_generator_are_refused():
    stages, _ = colocated()

    async def first_chunk():
        async for chunk in stages.generate(RawGenerateInputs(prompt="x", images=(b"raw",))):
            return chunk

    with pytest.raises(InvalidInput, match="metadata-only"):
        asyncio.run(first_chunk())


class EncodersOnly:
    """A remote side with encoders and no generator stage (``BlsEncoders``)."""

    async def encode(self, item, key, part=None):
        return "{}"


def test_a_stage_neither_here_nor_remote_is_refused():
    stages, _ = colocated(encoders=EncodersOnly())

    async def first_chunk():
        async for chunk in stages.generate(RawGenerateInputs(prompt="x"), Stage.PREFILL):
            return chunk

    with pytest.raises(ValueError, match="serves the pd stage; no client for the prefill stage"):
        asyncio.run(first_chunk())


# -- E/P/D: prefill's engine here, decode remote (over gRPC in production) -----------------------------------

HANDLE = {"remote_block_ids": [[1]], "do_remote_prefill": True}


def prefill_engine(**kwargs):
    """Prefill's engine: one token, its final output carrying the handle decode needs."""
    return FakeEngine(pieces=["x"], finish_reason="length", kv_transfer_params=HANDLE, **kwargs)


def test_e_p_d_prefill_runs_here_and_decode_goes_remote_with_prefill_s_kv_handle():
    pull, engine, observer = FakePull(), prefill_engine(), RecordingObserver()
    stages, remote = colocated(engine=engine, pull=pull, local=Stage.PREFILL)
    raw = RawGenerateInputs(prompt=f"{PH}Describe.", images=(b"A",), stream=True, sampling='{"max_tokens": 5, "min_tokens": 2}',
                            return_num_output_tokens=True)
    outcome, sink = run(stages, raw, observer=observer)
    assert outcome is Outcome.OK and remote.stages_called == [Stage.DECODE]  # only decode left the process
    [prefill] = pull.seen  # what the in-process prefill parsed: layouts, one token, do_remote_decode
    assert prefill.items == ('{"layout": 0}',) and not prefill.stream and prefill.sampling == {"max_tokens": 1}
    assert prefill.kv_transfer_params == {"do_remote_decode": True}
    [decode] = remote.generated  # the client's settings, the layouts and prefill's handle
    assert decode.image_layouts == ('{"layout": 0}',) and decode.images == () and decode.stream
    assert json.loads(decode.sampling) == {"max_tokens": 5, "min_tokens": 2}
    assert json.loads(decode.kv_transfer_params) == HANDLE
    assert [(c.text_output, final) for c, final in sink.chunks] == [("a", False), ("b", True)]
    timings = sink.chunks[-1][0].timings
    assert timings["items"] == 1 and 0 < timings["prefill_ms"] and timings["generate_ms"] <= timings["total_ms"]
    assert timings["transfer_ms"] == 0.5 and timings["transfer_bytes"] == 64  # the in-process pull's
    assert observer.finished == [(Outcome.OK, 2)] and engine.aborted == [] and sink.finals == 1


def test_e_p_d_client_cancel_during_decode_aborts_the_remote_stage():
    remote = FakeStages(pieces=["t"] * 50)
    stages, _ = colocated(engine=prefill_engine(), encoders=remote, local=Stage.PREFILL)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), FakeSink(cancel_after=2))
    assert outcome is Outcome.CANCELLED and sink.closed == 1 and len(sink.chunks) == 2
    assert remote.aborted == 1 and remote.stages_called == [Stage.DECODE]


def test_e_p_d_decode_unavailable_before_its_first_token_is_retried_from_the_encoders():
    """Decode fails before its first token (its KV could not be loaded -> Unavailable): nothing reached the
    client, so the items are encoded again and prefill (here) and decode asked again."""
    remote = FakeStages(generate_error=Unavailable("decode: KV transfer failed"), generate_failures=1)
    engine = prefill_engine()
    stages, _ = colocated(engine=engine, encoders=remote, local=Stage.PREFILL)
    observer = RecordingObserver()
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",)), observer=observer)
    assert outcome is Outcome.OK and observer.retried == ["request"]
    assert remote.stages_called == [Stage.DECODE, Stage.DECODE] and len(remote.encoded) == 2
    assert engine.requests == 2 and sink.chunks[-1][0].timings["retries"] == 1


def test_e_p_d_prefill_error_fails_before_decode_runs():
    engine = prefill_engine(fail_with=InvalidInput("text_input", "prompt too long for prefill"))
    stages, remote = colocated(engine=engine, local=Stage.PREFILL)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x"))
    assert outcome is Outcome.ERROR and str(sink.errors[0]) == "text_input: prompt too long for prefill"
    assert remote.stages_called == []


def test_e_p_d_deadline_while_decoding_cancels_the_remote_stage():
    remote = FakeStages(pieces=["t"] * 100)

    async def slow(inputs, stage=None, real=remote.generate):
        async for chunk in real(inputs, stage):
            await asyncio.sleep(0.01)
            yield chunk

    stages, _ = colocated(engine=prefill_engine(), encoders=remote, local=Stage.PREFILL)
    stages.remote.generate = slow
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), deadline=0.1)
    assert outcome is Outcome.EXPIRED and "deadline of 0.1 s exceeded while generating" in str(sink.errors[0])
    assert remote.aborted == 1


def test_e_p_d_asking_the_local_stage_for_e_pd_s_generate_goes_remote():
    """``local`` decides what runs here: an E/P/D process sends any other stage to its remote client."""
    stages, remote = colocated(local=Stage.PREFILL)

    async def chunks():
        return [c.text_output async for c in stages.generate(RawGenerateInputs(prompt="x"), Stage.PD)]

    assert asyncio.run(chunks()) == ["a", "b"] and remote.stages_called == [Stage.PD]


# -- E/P/D with decode's engine here too (decode_in_process) -----------------------------------------------------------

def test_e_p_d_with_decode_here_streams_decode_s_engine_with_prefill_s_handle_and_nothing_goes_remote():
    prefill, decode, decode_pull = prefill_engine(), FakeEngine(pieces=["d", "e"]), FakePull()
    remote = FakeStages()
    stages = LocalStages(remote, prefill, FakeLayoutResolver(), RequestLimits(max_images=4), prepare=FakePull(),
                         local=Stage.PREFILL, others={Stage.DECODE: LocalEngine(decode, FakeLayoutResolver(), decode_pull)})
    raw = RawGenerateInputs(prompt=f"{PH}Describe.", images=(b"A",), stream=True, sampling='{"max_tokens": 5}')
    outcome, sink = run(stages, raw)
    assert outcome is Outcome.OK and remote.stages_called == [] and len(remote.encoded) == 1
    [request] = decode_pull.seen  # decode parsed the layouts and prefill's handle, with the client's settings
    assert request.items == ('{"layout": 0}',) and request.kv_transfer_params == HANDLE and request.stream
    assert request.sampling == {"max_tokens": 5}
    assert [(c.text_output, final) for c, final in sink.chunks] == [("d", False), ("e", True)]
    assert prefill.requests == decode.requests == 1


def test_e_p_d_client_cancel_during_decode_here_aborts_decode_s_engine_request():
    decode = FakeEngine(pieces=["t"] * 50)
    stages = LocalStages(FakeStages(), prefill_engine(), FakeLayoutResolver(), RequestLimits(max_images=4),
                         prepare=FakePull(), local=Stage.PREFILL,
                         others={Stage.DECODE: LocalEngine(decode, FakeLayoutResolver())})
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), FakeSink(cancel_after=2))
    assert outcome is Outcome.CANCELLED and len(sink.chunks) == 2 and len(decode.aborted) == 1
