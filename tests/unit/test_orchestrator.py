import asyncio
import base64
import json

from backend.protocol.errors import InvalidInput, Overloaded, Unavailable
from backend.request.generate import RawGenerateInputs, RequestLimits
from backend.engine.serving import Outcome
from orchestrator.core import Identity, Orchestrator
from tests.fakes import FakeSink, FakeStages, RecordingObserver

IDENTITY = Identity("qwen2_vl:test", '{"max_pixels":12544}')


def run(stages, raw, sink=None, observer=None, deadline=0.0):
    sink = sink or FakeSink()
    orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(max_images=4), deadline=deadline)
    outcome = asyncio.run(orchestrator.run(raw, sink, observer))
    return outcome, sink


def test_media_are_encoded_concurrently_and_replaced_by_layouts():
    stages = FakeStages(encode_delay=0.05)
    outcome, sink = run(stages, RawGenerateInputs(prompt="<|image_pad|> and <|image_pad|>?", images=(b"A", b"B"),
                                                  sampling='{"max_tokens": 3}', stream=True))
    assert outcome is Outcome.OK and stages.peak == 2
    [sent] = stages.generated
    assert sent.images == () and sent.image_layouts == ('{"layout": 0}', '{"layout": 1}')
    assert sent.prompt == "<|image_pad|> and <|image_pad|>?" and sent.sampling == '{"max_tokens": 3}'
    keys = [key for _, key in stages.encoded]
    assert len(set(keys)) == 2  # content keys differ with the bytes
    assert [(c.text_output, final) for c, final in sink.chunks] == [("a", False), ("b", True)]
    assert sink.chunks[-1][0].timings["items"] == 2


def test_content_key_depends_on_bytes_processing_and_model():
    keys = []
    for identity in (IDENTITY, Identity("qwen2_vl:other", IDENTITY.processing), Identity(IDENTITY.model, "{}")):
        stages = FakeStages()
        asyncio.run(Orchestrator(stages, identity, RequestLimits()).run(
            RawGenerateInputs(prompt="x", images=(b"same",)), FakeSink()))
        keys.append(stages.encoded[0][1])
    assert len(set(keys)) == 3


def test_messages_are_rewritten_metadata_only():
    url = "data:image/png;base64," + base64.b64encode(b"PNGDATA").decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "hi"}, {"type": "image"}]}]
    stages = FakeStages()
    run(stages, RawGenerateInputs(messages=json.dumps(messages), images=(b"TENSOR",)))
    assert [data for data, _ in stages.encoded] == [b"PNGDATA", b"TENSOR"]
    [sent] = stages.generated
    assert "base64" not in sent.messages and sent.images == ()
    assert json.loads(sent.messages) == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"},
                                                                       {"type": "image"}]}]


def test_text_only_skips_the_encoder():
    stages = FakeStages()
    outcome, _ = run(stages, RawGenerateInputs(prompt="hello"))
    assert outcome is Outcome.OK and stages.encoded == [] and stages.generated[0].image_layouts == ()


def test_encoder_invalid_input_is_reported_under_the_clients_field():
    stages = FakeStages(encode_error=InvalidInput("image", "cannot decode image"), fail_item=1)
    observer = RecordingObserver()
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"ok", b"bad")), observer=observer)
    assert outcome is Outcome.ERROR and stages.generated == []
    [error] = sink.errors
    assert isinstance(error, InvalidInput) and str(error) == "image[1]: cannot decode image"
    assert observer.finished == [(Outcome.ERROR, 0)] and sink.finals == 1


def test_unavailable_encoder_fails_the_request_unavailable_after_one_retry():
    stages, observer = FakeStages(encode_error=Unavailable("embedding pool full"), fail_item={0, 1}), RecordingObserver()
    _, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",)), observer=observer)
    assert isinstance(sink.errors[0], Unavailable) and stages.generated == []
    assert len(stages.encoded) == 2 and observer.retried == ["encode"]


def test_an_overloaded_encoder_is_not_retried_and_the_item_is_named():
    stages, observer = FakeStages(encode_error=Overloaded("embedding pool full"), fail_item={0, 1}), RecordingObserver()
    _, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a", b"b")), observer=observer)
    [error] = sink.errors
    assert isinstance(error, Unavailable) and str(error).startswith("image[") and "overloaded: embedding pool full" in str(error)
    assert len(stages.encoded) <= 2 and observer.retried == [] and stages.generated == []


def test_a_failed_encode_is_retried_once_and_recovers():
    stages, observer = FakeStages(encode_error=Unavailable("encoder instance died"), fail_item=0), RecordingObserver()
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",)), observer=observer)
    assert outcome is Outcome.OK and len(stages.encoded) == 2 and observer.retried == ["encode"]
    assert sink.chunks[-1][0].timings["retries"] == 1


def test_a_lost_embedding_is_encoded_again_and_the_request_retried():
    stages = FakeStages(generate_error=Unavailable("lease expired", "image_layouts[0]"), generate_failures=1)
    observer = RecordingObserver()
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",), stream=True), observer=observer)
    assert outcome is Outcome.OK and observer.retried == ["request"]
    assert len(stages.encoded) == 2 and len(stages.generated) == 2  # fresh leases for the second attempt
    assert [c.text_output for c, _ in sink.chunks] == ["a", "b"] and sink.chunks[-1][0].timings["retries"] == 1


def test_no_retry_once_the_client_got_text_or_after_the_second_failure():
    stages = FakeStages(generate_error=Unavailable("decode went away"), generate_failures=1, fail_after_chunks=1)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",), stream=True))
    assert outcome is Outcome.ERROR and len(stages.generated) == 1 and isinstance(sink.errors[0], Unavailable)
    stages = FakeStages(generate_error=Unavailable("lease expired", "image_layouts[1]"), generate_failures=2)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a", b"b")))
    assert outcome is Outcome.ERROR and len(stages.generated) == 2
    assert str(sink.errors[0]) == "image[1]: lease expired"  # named as the client sent it


def test_deadline_fails_the_request_naming_the_phase():
    stages = FakeStages(encode_delay=1.0)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"a",)), deadline=0.1)
    assert outcome is Outcome.EXPIRED and stages.generated == []
    [error] = sink.errors
    assert isinstance(error, Unavailable) and "deadline of 0.1 s exceeded while encoding" in str(error)


def test_validation_errors_happen_before_any_stage_is_called():
    stages = FakeStages()
    _, sink = run(stages, RawGenerateInputs(prompt="x", sampling='{"max_tokens": -1}', images=(b"a",)))
    assert sink.errors[0].field == "sampling_parameters.max_tokens" and stages.encoded == []


def test_client_cancel_stops_forwarding():
    stages = FakeStages(pieces=["t"] * 10)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True), FakeSink(cancel_after=2))
    assert outcome is Outcome.CANCELLED and sink.closed == 1 and len(sink.chunks) == 2
    assert stages.aborted == 1  # the stage was told to stop


def test_finished_streams_are_not_aborted():
    stages = FakeStages()
    run(stages, RawGenerateInputs(prompt="x"))
    assert stages.aborted == 0


def test_e_p_d_prefills_one_token_then_decodes_with_the_kv_handle():
    from backend.protocol.stages import Disaggregation, Stage

    stages = FakeStages()
    raw = RawGenerateInputs(prompt="x", images=(b"A",), stream=True,
                            sampling='{"max_tokens": 9, "min_tokens": 2, "temperature": 0}')
    sink = FakeSink()
    outcome = asyncio.run(Orchestrator(stages, IDENTITY, RequestLimits(), Disaggregation.E_P_D).run(raw, sink))
    assert outcome is Outcome.OK and stages.stages_called == [Stage.PREFILL, Stage.DECODE]
    prefill, decode = stages.generated
    assert json.loads(prefill.sampling) == {"max_tokens": 1, "temperature": 0}
    assert json.loads(prefill.kv_transfer_params) == {"do_remote_decode": True} and prefill.stream is False
    assert decode.sampling == raw.sampling and decode.stream  # the client's own settings
    assert json.loads(decode.kv_transfer_params)["remote_block_ids"] == [[1]]
    assert prefill.image_layouts == decode.image_layouts == ('{"layout": 0}',)
    timings = sink.chunks[-1][0].timings
    assert timings["prefill_ms"] > 0 and timings["transfer_ms"] == 1.0


def test_metadata_only_off_forwards_the_original_media_to_every_consumer():
    from backend.protocol.stages import Disaggregation

    url = "data:image/png;base64," + base64.b64encode(b"PNGDATA").decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "image"}]}]
    raw = RawGenerateInputs(messages=json.dumps(messages), images=(b"TENSOR",))
    for disaggregation, consumers in ((Disaggregation.E_PD, 1), (Disaggregation.E_P_D, 2)):
        for model_setting, request_setting, naive in ((True, None, False), (False, None, True), (True, False, True),
                                                      (False, True, False)):
            stages = FakeStages()
            orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(), disaggregation, metadata_only=model_setting)
            assert asyncio.run(orchestrator.run(raw, FakeSink(), metadata_only=request_setting)) is Outcome.OK
            assert len(stages.generated) == consumers and len(stages.encoded) == 2  # encoders run either way
            for sent in stages.generated:
                assert sent.image_layouts == ('{"layout": 0}', '{"layout": 1}') and "base64" not in sent.messages
                assert sent.original_media == ((b"PNGDATA", b"TENSOR") if naive else ())


def test_consumers_media_time_adds_up_over_prefill_and_decode():
    from orchestrator.core import _merge

    timings = {"items": 1}
    _merge(timings, {"media_ms": 1.5, "transfer_ms": 2.0})
    _merge(timings, {"media_ms": 2.25})
    _merge(timings, None)
    assert timings == {"items": 1, "media_ms": 3.75, "transfer_ms": 2.0}


def test_p_d_skips_the_encoders_and_sends_the_request_as_it_came():
    """encode=False (P/D): no encode call; prefill and decode both get the client's media and messages
    unchanged (they process the media themselves); a deployment whose stages take metadata-only media refuses."""
    from backend.protocol.stages import Disaggregation, Stage

    url = "data:image/png;base64," + base64.b64encode(b"PNGDATA").decode()
    messages = json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "image"}]}])
    raw = RawGenerateInputs(messages=messages, images=(b"TENSOR",), sampling='{"max_tokens": 5}')
    stages, sink = FakeStages(), FakeSink()
    orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(), Disaggregation.E_P_D, stages_take_media=True)
    assert asyncio.run(orchestrator.run(raw, sink, encode=False)) is Outcome.OK
    assert stages.encoded == [] and stages.stages_called == [Stage.PREFILL, Stage.DECODE]
    for sent in stages.generated:
        assert sent.images == (b"TENSOR",) and sent.messages == messages and sent.image_layouts == ()
    assert json.loads(stages.generated[1].kv_transfer_params)["remote_block_ids"] == [[1]]
    assert sink.chunks[-1][0].timings["items"] == 0

    for disaggregation, take_media in ((Disaggregation.E_PD, False), (Disaggregation.E_P_D, False)):
        stages, sink = FakeStages(), FakeSink()
        outcome = asyncio.run(Orchestrator(stages, IDENTITY, RequestLimits(), disaggregation, stages_take_media=take_media)
                              .run(raw, sink, encode=False))
        assert outcome is Outcome.ERROR and stages.generated == [] and stages.encoded == []
        assert [type(e) for e in sink.errors] == [InvalidInput] and sink.errors[0].field == "parameters.epd_encode"


class ProducerStages(FakeStages):
    """Encoders whose layouts name their producer (``handle.agent_name``), or, from ``broken``, are not JSON."""

    def __init__(self, agents, broken=False):
        super().__init__()
        self.agents, self.broken = list(agents), broken

    async def encode(self, item, key, part=None):
        index = len(self.encoded)
        await super().encode(item, key, part)
        return "not json" if self.broken else json.dumps({"handle": {"agent_name": self.agents[index]}})


def test_the_encoders_that_served_the_items_are_read_from_their_layouts_once():
    stages = ProducerStages(["enc-b", "enc-a", "enc-b"])
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"A", b"B", b"C")))
    assert outcome is Outcome.OK and sink.chunks[-1][0].timings["encoders"] == ["enc-a", "enc-b"]
    assert [json.loads(text)["handle"]["agent_name"] for text in stages.generated[0].image_layouts] == ["enc-b", "enc-a", "enc-b"]


def test_a_layout_that_is_not_json_fails_the_item_unavailable_after_one_retry():
    stages = ProducerStages([], broken=True)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", images=(b"A",)))
    assert outcome is Outcome.ERROR and isinstance(sink.errors[0], Unavailable) and sink.errors[0].field == "image[0]"
    assert len(stages.encoded) == 2 and stages.generated == []


class HoldingStages(FakeStages):
    """A consumer stage that holds some items (``held``: content key -> layout text): the demand-aware lookup."""

    def __init__(self, held=None, lookup_error=None, lookup_delay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.holding, self.lookup_error, self.lookup_delay = dict(held or {}), lookup_error, lookup_delay
        self.lookups = []

    async def held(self, keys, session, stage):
        self.lookups.append((list(keys), session, stage))
        await asyncio.sleep(self.lookup_delay)
        if self.lookup_error is not None:
            raise self.lookup_error
        return {key: text for key, text in self.holding.items() if key in keys}


ONE_IMAGE = RawGenerateInputs(prompt="<|image_pad|>", images=(b"A",), session_id="conv-1")


def demand_run(stages, raw, demand_aware=True, before=(ONE_IMAGE,)):
    """``raw`` after the requests ``before`` (turn 1: image A), on one orchestrator; (outcome, sink) of ``raw``."""
    orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(max_images=4), demand_aware=demand_aware)

    async def turns():
        for earlier in before:
            await orchestrator.run(earlier, FakeSink())
        stages.encoded, stages.generated, stages.lookups = [], [], []  # what ``raw`` does, from here
        sink = FakeSink()
        return await orchestrator.run(raw, sink), sink

    return asyncio.run(turns())


TWO_IMAGES = RawGenerateInputs(prompt="<|image_pad|> <|image_pad|>", images=(b"A", b"B"), session_id="conv-1")


def key_of(data):
    from backend.protocol.layout import content_key
    return content_key(data, IDENTITY.processing, IDENTITY.model)


def test_demand_aware_sends_the_consumers_copy_and_encodes_only_the_rest():
    stages = HoldingStages(held={key_of(b"A"): '{"held": "A"}'})
    outcome, sink = demand_run(stages, TWO_IMAGES)
    assert outcome is Outcome.OK
    assert [data for data, _ in stages.encoded] == [b"B"]  # A skipped: the consumer holds it
    [sent] = stages.generated
    assert sent.image_layouts == ('{"held": "A"}', '{"layout": 0}') and sent.session_id == "conv-1"  # prompt order
    [(keys, session, stage)] = stages.lookups
    assert keys == [key_of(b"A")] and session == "conv-1" and stage.value == "pd"  # B was never sent
    timings = sink.chunks[-1][0].timings
    assert timings["held"] == 1 and timings["items"] == 2 and timings["lookup_ms"] >= 0


def test_a_cold_request_costs_no_lookup_and_only_keys_sent_before_are_asked_about():
    stages = HoldingStages(held={key_of(b"A"): '{"held": "A"}'})
    outcome, sink = demand_run(stages, TWO_IMAGES, before=())  # nothing sent yet: the consumer can hold nothing
    assert outcome is Outcome.OK and stages.lookups == [] and len(stages.encoded) == 2
    assert sink.chunks[-1][0].timings["held"] == 0 and "lookup_ms" not in sink.chunks[-1][0].timings
    demand_run(stages, TWO_IMAGES)  # after a turn with A: asked about A only
    assert [keys for keys, _, _ in stages.lookups] == [[key_of(b"A")]]


def test_demand_aware_is_off_unless_asked_and_a_request_may_turn_it_on_or_off():
    stages = HoldingStages(held={key_of(b"A"): '{"held": "A"}'})
    assert demand_run(stages, TWO_IMAGES, demand_aware=False)[0] is Outcome.OK
    assert stages.lookups == [] and len(stages.encoded) == 2
    orchestrator = Orchestrator(stages, IDENTITY, RequestLimits(max_images=4), demand_aware=True)
    asyncio.run(orchestrator.run(TWO_IMAGES, FakeSink(), demand_aware=False))
    assert stages.lookups == [] and len(stages.encoded) == 4


def test_a_failed_or_slow_lookup_encodes_every_item_and_the_request_succeeds(monkeypatch):
    monkeypatch.setattr(Orchestrator, "LOOKUP_SECONDS", 0.05)
    for stages in (HoldingStages(held={key_of(b"A"): "x"}, lookup_error=Unavailable("pd not reachable")),
                   HoldingStages(held={key_of(b"A"): "x"}, lookup_delay=1.0)):
        outcome, sink = demand_run(stages, TWO_IMAGES)
        assert outcome is Outcome.OK and len(stages.encoded) == 2 and sink.chunks[-1][0].timings["held"] == 0


def test_a_copy_gone_at_the_consumer_is_encoded_and_the_request_retried_without_a_lookup():
    stages = HoldingStages(held={key_of(b"A"): '{"held": "A"}'}, generate_error=Unavailable("lease released", "image_layouts[0]"),
                           generate_failures=1)
    outcome, sink = demand_run(stages, TWO_IMAGES)
    assert outcome is Outcome.OK and len(stages.lookups) == 1
    assert [data for data, _ in stages.encoded] == [b"B", b"A", b"B"]  # the retry encodes everything
    assert stages.generated[1].image_layouts == ('{"layout": 1}', '{"layout": 2}')
    assert sink.chunks[-1][0].timings["retries"] == 1


def test_a_consumer_answer_naming_keys_not_asked_for_is_ignored():
    stages = HoldingStages(held={key_of(b"A"): '{"held": "A"}'})
    stages.holding["unasked"] = "y"
    original = stages.held

    async def leaky(keys, session, stage):
        return {**(await original(keys, session, stage)), "unasked": "y"}

    stages.held = leaky
    outcome, sink = demand_run(stages, TWO_IMAGES)
    assert outcome is Outcome.OK and sink.chunks[-1][0].timings["held"] == 1


def test_a_video_s_options_make_its_content_key_and_go_on_to_the_consumer():
    from backend.protocol.media_options import MediaOptions
    from tests.videos import make_video

    video = make_video(64, 48, frames=8, fps=4)
    keys = []
    for options in (None, {"video": {"fps": 1}}, {"video": {"fps": 3}}, {"video": {"fps": 1.0}}):
        stages = FakeStages()
        raw = RawGenerateInputs(prompt="<|video_pad|>?", videos=(video,), media_io=MediaOptions.parse(options))
        outcome, _ = run(stages, raw)
        assert outcome is Outcome.OK
        keys.append(stages.encoded[0][1])
        assert stages.generated[0].media_io == raw.media_io  # consumers that decode media sample them alike
    assert len(set(keys[:3])) == 3 and keys[3] == keys[1]  # other options: another item; 1 == 1.0: the same


def test_the_answerer_checks_the_run_options_and_runs_the_request():
    stages = FakeStages()
    answer = Orchestrator(stages, IDENTITY, RequestLimits(max_images=4)).answerer()
    bad = FakeSink()
    asyncio.run(answer(RawGenerateInputs(prompt="hi"), {"epd_metadata_only": "yes"}, bad))
    assert [str(e) for e in bad.errors] == ["parameters.epd_metadata_only: expected a bool, got 'yes'"]
    assert stages.generated == [] and bad.chunks == []
    good = FakeSink()
    asyncio.run(answer(RawGenerateInputs(prompt="hi"), {"epd_encode": True}, good))
    assert good.errors == [] and good.chunks[-1][1] is True


def test_a_stage_call_cancelled_under_the_request_is_its_error_and_the_request_is_completed():
    """A ``CancelledError`` from a call under the request (grpc.aio: its channel closed) is not a cancel of the
    request's task: the client gets an error naming the phase instead of a stream that never ends."""
    stages = FakeStages(generate_error=asyncio.CancelledError(), generate_failures=1, fail_after_chunks=1)
    outcome, sink = run(stages, RawGenerateInputs(prompt="x", stream=True))
    assert outcome is Outcome.ERROR and sink.finals == 1
    [error] = sink.errors
    assert isinstance(error, Unavailable) and "cancelled while generating" in str(error)


def test_a_request_whose_task_is_cancelled_is_still_completed():
    """The model unloading cancels the loop's tasks: each request still gets its final flag (a decoupled request
    without one keeps Triton from unloading the model)."""
    async def scenario():
        stages, sink = FakeStages(encode_delay=10), FakeSink()
        task = asyncio.ensure_future(Orchestrator(stages, IDENTITY, RequestLimits()).run(
            RawGenerateInputs(prompt="x", images=(b"a",)), sink))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return sink
    sink = asyncio.run(scenario())
    assert sink.closed == 1 and sink.finals == 1
