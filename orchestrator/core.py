"""The ``epd`` orchestration: validate, encode every media item concurrently, rewrite the request to
metadata-only, stream the generator's output back.

The disaggregation (``backend.protocol.stages.Disaggregation``): E+PD sends the rewritten request to one generator (``pd``); E/P/D sends it
to ``prefill`` with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then to
``decode`` with the ``kv_transfer_params`` prefill returned (decode pulls the KV through NIXL and needs
only the media layouts), and streams decode's output.

Request lifecycle::

    RECEIVED -> VALIDATED (parse with EncodedMedia: media stay bytes, nothing decoded here)
             -> ENCODING  (one StageClient.encode per item, all at once; text-only requests skip it; with
                           video_split N, one per part of each video, N parts, all at once too)
             -> REWRITTEN (per modality, backend.protocol.modality: media tensor removed, messages' media parts ->
                           {"type": "image"}, image_layouts = the encoders' layout metadata, in prompt order;
                           text_input / sampling settings untouched)
                          [metadata-only off: original_media = the client's media, beside them]
             -> [E/P/D: PREFILLING -> kv_transfer_params]
             -> GENERATING (StageClient.generate streams chunks) -> DONE | FAILED | CANCELLED

Recovery: the orchestrator keeps the original media until the request is done. An item whose encode fails
(anything but INVALID_ARG, e.g. an encoder instance that died) is encoded once more, except when the encoder
is overloaded (its pool full): retrying at once would only add load, the request fails with UNAVAILABLE. If a generator stage
answers UNAVAILABLE before anything reached the client (an embedding or KV that could not be pulled, a lease
that expired or was released, a stage that restarted), every item is encoded again (fresh leases) and the
stages are asked once more. Both count in ``timings["retries"]`` and ``RequestObserver.request_retried``.
A ``deadline`` (seconds, 0: none) bounds the whole request, and a request's own (``deadline_ms``) may be shorter;
past it the request fails with UNAVAILABLE (``DeadlineExceeded``) naming the phase it was in, and the stage streams
still open are closed (their requests cancelled). The stages get the absolute deadline and the request's priority
(``epd_deadline``, ``epd_priority``): each checks it before it works on the request and stops there when it passes.

Admission (``orchestrator.admission``, with budgets set): before each stage, the request takes its share of that stage's
budget (the encoder: its items and bytes; a generator: one request) in priority order, or is refused before any
work when it cannot start in time (``Overloaded`` with ``retry_after``).

P/D (``run(encode=False)``, a request's ``epd_encode=false`` parameter; E/P/D with its own prefill and decode
models only): no encoder stage; the request goes to prefill and decode as the client sent it, media included,
and each engine processes the media itself, as vLLM's own P/D disaggregation does (the reference the E/P/D
outputs are compared with).

Metadata-only off (``metadata_only=False``, the model's parameter or a request's ``epd_metadata_only``
parameter): the "naive EPD" the metadata-only design is measured against. Encoders still run, and the
consumer stages still take the embeddings from them, but they also get the client's original media
(``original_media``) and decode and preprocess it themselves (``backend.request.naive_media``), as a consumer
given the unmodified request would; the time that costs comes back as ``timings["media_ms"]`` (summed
over prefill and decode in E/P/D).

Written against ``StageClient`` so it runs with a fake in unit tests (``tests/fakes.py``) and with
Triton (BLS to encoders, gRPC streams to generator stages) in the ``epd`` model (``backend.triton.stage_client``).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol

from backend.engine.serving import Outcome, RequestObserver, ResponseChunk, ResponseSink
from backend.protocol.errors import DeadlineExceeded, InvalidInput, Overloaded, Unavailable
from backend.protocol.generate import DEMAND_AWARE_PARAMETER, ENCODE_PARAMETER, METADATA_ONLY_PARAMETER
from backend.protocol.layout import content_key
from backend.protocol.modality import VIDEO, modalities
from backend.protocol.stages import Disaggregation, Stage
from backend.request.generate import EncodedMedia, MediaBytes, RawGenerateInputs, RequestLimits, parse_generate_request
from orchestrator.admission import Admission, Allowance, Cost, Ticket, Urgency, URGENCY
from orchestrator.health import cancelled_here

log = logging.getLogger(__name__)


class StageClient(Protocol):
    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        """Encode one item, or part ``(i, n)`` of a video (``backend.protocol.generate.PART_PARAMETER``); returns its
        layout metadata JSON ("" for a part with no temporal patches). Raises ``EpdError``s."""

    def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.PD) -> AsyncIterator[ResponseChunk]:
        """Stream the chunks of the generator stage ``stage`` (pd, prefill or decode); the one carrying ``finish_reason`` is the last. Closing the
        stream before that (``aclose``) must stop the stage's work for this request."""

    # optional (demand-aware encoding): ``async def held(self, keys: list[str], session: str | None, stage: Stage)
    # -> dict[str, str]``, the layout documents of the keys the consumer stage ``stage`` holds
    # (``backend.transfer.held``: it serves them as its own copies when they come back). Raises on failure.


@dataclass(frozen=True)
class Identity:
    """What makes a content key: the model and its processing options."""

    model: str
    processing: str


class Orchestrator:
    RETRIES = 1  # per item encode, and per request after a generator stage's UNAVAILABLE
    LOOKUP_SECONDS = 0.5  # a demand-aware lookup slower than this counts as failed (the items are encoded)
    SENT_KEYS = 1 << 16  # content keys of the items sent to the consumers, remembered (least recent out first)
    _lookup_failed = False  # one warning per orchestrator

    def __init__(self, stages: StageClient, identity: Identity, limits: RequestLimits,
                 disaggregation: Disaggregation = Disaggregation.E_PD, deadline: float = 0.0,
                 metadata_only: bool = True, stages_take_media: bool = False, video_split: int = 1,
                 demand_aware: bool = False, admission: Admission | None = None):
        """``disaggregation``: which generator stages a request goes through (``disaggregation.generators``, the
        last streams to the client). ``stages_take_media``: the generator stages also take the client's media (E/P/D's own prefill and
        decode models), so a request may skip the encoders (``run(encode=False)``: P/D). ``video_split``: each video
        of a metadata-only request is encoded in that many parts at once (their layouts go on in order; a video of
        fewer temporal patches has that many parts, the encoders answer the others with nothing). ``demand_aware``:
        before encoding, ask the consumer stage which items it holds (``StageClient.held``) and encode only the
        others. ``admission``: the stages' budgets (None: none)."""
        self.admission = admission or Admission()
        self.stages, self.identity, self.limits, self.disaggregation = stages, identity, limits, disaggregation
        self.video_split, self.demand_aware = video_split, demand_aware
        self._sent: collections.OrderedDict[str, None] = collections.OrderedDict()  # demand-aware: keys sent
        self.deadline, self.metadata_only, self.stages_take_media = deadline, metadata_only, stages_take_media
        self.media = EncodedMedia(limits.media)

    def validate(self, raw: RawGenerateInputs):
        """Cheap checks before anything is scheduled (errors are INVALID_ARG naming the field)."""
        return parse_generate_request(raw, self.media, self.limits)

    async def run(self, raw: RawGenerateInputs, sink: ResponseSink, observer: RequestObserver | None = None,
                  metadata_only: bool | None = None, encode: bool = True, demand_aware: bool | None = None) -> Outcome:
        """``metadata_only``, ``demand_aware``: this request's choice (None: the orchestrator's). ``encode=False``:
        P/D, the encoders are skipped and the generator stages get the client's request as it came, media included."""
        started = time.perf_counter()
        state = _State(observer)
        state.metadata_only = self.metadata_only if metadata_only is None else metadata_only
        state.demand_aware = self.demand_aware if demand_aware is None else demand_aware
        state.encode = encode
        try:
            if not encode and not self.stages_take_media:
                raise InvalidInput(f"parameters.{ENCODE_PARAMETER}", "false needs E/P/D with prefill and decode models of their "
                                   "own (they then process the media); this deployment's engines take metadata-only media")
            now = time.time()
            deadline = min((d for d in (now + self.deadline if self.deadline else None, raw.deadline) if d),
                           default=None)
            state.deadline = deadline
            async with asyncio.timeout(None if deadline is None else deadline - now):
                await self._run(raw, sink, state, started)
        except TimeoutError:
            state.outcome = Outcome.EXPIRED
            sink.send_error(DeadlineExceeded(f"deadline of {max(0.0, round(state.deadline - now, 3)):g} s exceeded while "
                                             f"{state.phase}", "request"))
        except (DeadlineExceeded, Overloaded) as exc:
            state.outcome = Outcome.EXPIRED if isinstance(exc, DeadlineExceeded) else Outcome.SHED
            sink.send_error(exc)
        except asyncio.CancelledError:
            if cancelled_here():  # the model unloading: the request is still completed, or it would never unload
                sink.close()
                raise
            # a call under it was cancelled (grpc.aio, a closed channel): the request's error, not a silent end
            sink.send_error(Unavailable(f"a stage call was cancelled while {state.phase}"))
        except Exception as exc:
            sink.send_error(exc)
        finally:
            if observer is not None:
                observer.request_finished(state.outcome, state.tokens)
        return state.outcome

    def answerer(self, observer: RequestObserver | None = None):
        """``run`` for one request given as values and its request parameters (``run_options``; bad ones are sent
        to the sink as the request's error): the in-process OpenAI endpoint's request function
        (``frontend.openai.in_process``) of an orchestrator model."""
        async def answer(raw: RawGenerateInputs, params: dict, sink: ResponseSink) -> None:
            try:
                options = run_options(params)
            except Exception as exc:
                sink.send_error(exc)
                return
            await self.run(raw, sink, observer, *options)
        return answer

    async def _run(self, raw: RawGenerateInputs, sink: ResponseSink, state: "_State", started: float) -> None:
        timings = state.timings
        request = self.validate(raw)
        state.urgency = Urgency(request.priority, state.deadline)
        URGENCY.set(state.urgency)  # this request's task (its encodes' too): the stage clients send it on
        raw = replace(raw, priority=request.priority, deadline=state.deadline)
        cost = Cost(len(request.items), sum(len(item.data) for item in request.items))
        passes = [(self.admission.encoder, cost)] if state.encode and request.items else []
        passes += [(self.admission.generator(stage.value), Cost()) for stage in self.disaggregation.generators]
        state.allowance = self.admission.check(passes, request.priority, state.deadline)  # before any work
        owners = request.items  # the client's item of each layout the stages get
        while True:
            if state.encode:
                state.phase = "encoding"
                async with self.admission.encoder.admit(cost, request.priority, state.deadline, state.allowance) \
                        if request.items else contextlib.nullcontext():
                    encoded = await self._encode_all(request.items, state, raw.session_id)
                owners, layouts = tuple(item for item, _ in encoded), [layout for _, layout in encoded]
                timings.update(items=len(request.items), encode_ms=_ms(started),
                               encoders=sorted({layout.producer for layout in layouts if layout.producer}))
                if len(layouts) > len(request.items):
                    timings["parts"] = len(layouts)
                rewritten = _metadata_only(raw, request, encoded, state.metadata_only)
            else:  # P/D: the request as it came (validated above); prefill and decode process its media
                rewritten = raw
            try:
                await self._generate(rewritten, sink, state, started)
                return
            except Unavailable as exc:
                if not exc.retryable or state.sent or state.request_retries >= self.RETRIES:  # shed, or past its deadline
                    raise _in_client_terms(exc, owners) from None
                state.retried("request")  # nothing reached the client: encode again, ask the stages again

    async def _generate(self, rewritten: RawGenerateInputs, sink: ResponseSink, state: "_State", started: float) -> None:
        timings = state.timings
        if Stage.PREFILL in self.disaggregation.generators:
            state.phase = "prefilling"
            async with self.admission.generator(Stage.PREFILL.value).admit(Cost(), state.urgency.priority,
                                                                           state.deadline, state.allowance) as ticket:
                rewritten = await self._prefill(rewritten, timings)
                ticket.first_token()  # prefill's one token
        state.phase = "generating"
        async with self.admission.generator(self.disaggregation.streamer.value).admit(
                Cost(), state.urgency.priority, state.deadline, state.allowance) as ticket:
            await self._stream(rewritten, sink, state, started, ticket)

    async def _stream(self, rewritten: RawGenerateInputs, sink: ResponseSink, state: "_State", started: float,
                      ticket: Ticket) -> None:
        """The streamer's chunks to the client; its gate's ``ticket`` told of the first."""
        timings = state.timings
        generate_started = time.perf_counter()
        stream = self.stages.generate(rewritten, self.disaggregation.streamer)
        try:
            async for chunk in stream:
                if sink.is_cancelled():
                    sink.close()
                    state.outcome = Outcome.CANCELLED
                    return
                final = chunk.finish_reason is not None
                ticket.first_token()
                if final:
                    state.tokens = chunk.num_output_tokens or 0
                    _merge(timings, chunk.timings)  # the generator's own (pd: transfer_ms)
                    timings.update(generate_ms=_ms(generate_started), total_ms=_ms(started))
                    if state.allowance is not None and state.allowance.waited is not None:  # passed a bounded gate
                        timings["queued_ms"] = round(state.allowance.waited * 1000, 3)
                    chunk = replace(chunk, timings=dict(timings))
                elif "first_chunk_ms" not in timings:
                    timings["first_chunk_ms"] = _ms(started)
                sink.send(chunk, final=final)
                state.sent = True
                if final:
                    state.outcome = Outcome.OK
                    return
        finally:
            await stream.aclose()  # an unfinished stream tells its stage to abort
        raise RuntimeError("the generator's stream ended without a final response")

    async def _prefill(self, rewritten: RawGenerateInputs, timings: dict) -> RawGenerateInputs:
        """Run prefill for one token; return the request for decode, carrying prefill's KV handle."""
        started = time.perf_counter()
        sampling = json.loads(rewritten.sampling) if rewritten.sampling else {}
        sampling = {k: v for k, v in sampling.items() if k not in ("min_tokens",)}
        prefill_inputs = replace(
            rewritten, stream=False, sampling=json.dumps({**sampling, "max_tokens": 1}),
            kv_transfer_params=json.dumps({"do_remote_decode": True}), exclude_input_in_output=True,
            return_num_input_tokens=False, return_num_output_tokens=False)
        params = None
        async for chunk in self.stages.generate(prefill_inputs, Stage.PREFILL):
            if chunk.finish_reason is not None:
                params = chunk.kv_transfer_params
                _merge(timings, chunk.timings)  # prefill's embedding pull (transfer_ms)
        if not params:
            raise Unavailable("prefill returned no kv_transfer_params")
        timings["prefill_ms"] = _ms(started)
        return replace(rewritten, kv_transfer_params=json.dumps(params))

    async def _encode_all(self, items: tuple[MediaBytes, ...], state: "_State",
                          session: str | None = None) -> list[tuple[MediaBytes, "EncodedLayout"]]:
        """Every item's layouts, in order, each with its item: one per item, or one per part of a video split in
        parts (those with no temporal patches left out); those the consumer holds (``_held``) as its copies."""
        if not items:
            return []
        split = self.video_split if state.metadata_only else 1  # naive EPD's consumers pair media and layouts 1:1
        jobs = [(item, part, content_key(item.data, self.identity.processing, self.identity.model, part,
                                          item.options))
                for item in items
                for part in ([(i, split) for i in range(split)] if item.modality == VIDEO.name and split > 1 else [None])]
        held = await self._held([key for _, _, key in jobs], session, state)

        async def layout(item: MediaBytes, part, key: str) -> "EncodedLayout | None":
            if key in held:
                return EncodedLayout.read(held[key], item.field)
            return await self._encode(item, key, state, part)

        layouts = await asyncio.gather(*(layout(*job) for job in jobs))
        return [(item, layout) for (item, _, _), layout in zip(jobs, layouts) if layout is not None]

    async def _held(self, keys: list[str], session: str | None, state: "_State") -> dict[str, str]:
        """Demand-aware encoding: the layouts of the ``keys`` the consumer stage holds (``StageClient.held``), asked
        within ``LOOKUP_SECONDS`` about the keys this orchestrator sent before (``SENT_KEYS``); nothing on a retry (a copy was missing: encode everything), when off, or when the
        lookup fails (logged once; the items are encoded as without it). ``timings``: ``held`` items, ``lookup_ms``."""
        lookup = getattr(self.stages, "held", None)
        if not state.demand_aware or not state.metadata_only or lookup is None or state.request_retries:
            return {}
        # a consumer holds only what an orchestrator sent it: keys this one never sent are not asked about, so a
        # cold request costs no lookup (another orchestrator's items are then encoded: a missed saving, never an error)
        asked = [key for key in keys if key in self._sent]
        for key in keys:
            self._sent[key] = None
            self._sent.move_to_end(key)
        while len(self._sent) > self.SENT_KEYS:
            self._sent.popitem(last=False)
        if not asked:
            state.timings["held"] = 0
            return {}
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.LOOKUP_SECONDS):
                found = await lookup(asked, session, self.disaggregation.generators[0])
        except Exception as exc:  # noqa: BLE001 - an optimisation only
            if not self._lookup_failed:
                self._lookup_failed = True
                log.warning("demand-aware lookup at %s failed (%s); encoding as without it (logged once)",
                            self.disaggregation.generators[0].value,
                            f"no answer within {self.LOOKUP_SECONDS:g} s" if isinstance(exc, TimeoutError) else exc)
            found = {}
        found = {key: text for key, text in found.items() if key in asked and isinstance(text, str)}
        state.timings.update(held=len(found), lookup_ms=_ms(started))
        return found

    async def _encode(self, item: MediaBytes, key: str, state: "_State",
                      part: tuple[int, int] | None = None) -> "EncodedLayout | None":
        for attempt in range(self.RETRIES + 1):
            try:
                text = await self.stages.encode(item, key, part)
                return None if part and text == "" else EncodedLayout.read(text, item.field)
            except InvalidInput as exc:  # the encoder names "image"; the client sent it as item.field
                raise InvalidInput(item.field, exc.problem) from None
            except Overloaded as exc:  # no retry: asking a full encoder again at once only adds load
                raise Overloaded(str(exc), item.field) from None
            except Exception as exc:
                if attempt == self.RETRIES:
                    if isinstance(exc, Unavailable) and exc.field != item.field:
                        raise Unavailable(str(exc), item.field) from None
                    raise
                state.retried("encode")
        raise AssertionError("unreachable")


class _State:
    """One request's progress, shared by the phases (and read when the deadline strikes)."""

    def __init__(self, observer: RequestObserver | None):
        self.observer = observer
        self.phase = "validating"
        self.outcome, self.tokens, self.sent = Outcome.ERROR, 0, False
        self.request_retries = 0
        self.timings: dict = {"items": 0, "encode_ms": 0.0}
        self.metadata_only, self.encode, self.demand_aware = True, True, False
        self.deadline: float | None = None  # Unix time
        self.allowance: Allowance | None = None  # what it may still wait for stages' budgets (admission)
        self.urgency = Urgency()

    def retried(self, what: str) -> None:
        if what == "request":
            self.request_retries += 1
        self.timings["retries"] = self.timings.get("retries", 0) + 1
        if self.observer is not None:
            self.observer.request_retried(what)


@dataclass(frozen=True)
class EncodedLayout:
    """One item's layout as its encoder returned it, read once: ``text`` goes on to the stages untouched (they check
    it, ``backend.protocol.layout``); ``producer`` names the encoder instance holding the embeddings (its NIXL agent;
    "" where the document names none)."""

    text: str
    producer: str

    @classmethod
    def read(cls, text: str, field: str) -> "EncodedLayout":
        """An encoder's answer that is no JSON document is UNAVAILABLE (the encoder at fault: asked again)."""
        try:
            doc = json.loads(text)
        except (TypeError, ValueError):
            raise Unavailable("the encoder answered a layout that is not JSON", field) from None
        handle = doc.get("handle") if isinstance(doc, dict) else None
        producer = handle.get("agent_name") if isinstance(handle, dict) else None
        return cls(text, producer if isinstance(producer, str) else "")


def _metadata_only(raw: RawGenerateInputs, request, layouts: list[tuple[MediaBytes, EncodedLayout]],
                   metadata_only: bool) -> RawGenerateInputs:
    """The request for the generator stages: no media, each modality's layouts (the encoders' answers, each with its
    item, in prompt order), messages' media parts as {"type": <item part>}; metadata-only off: the client's media
    beside them."""
    fields = {}
    for m in modalities():
        fields[m.media_field] = ()
        fields[m.layout_field] = tuple(layout.text for item, layout in layouts if item.modality == m.name)
    fields = {name: value for name, value in fields.items() if hasattr(raw, name)}
    return replace(raw, **fields, original_media=() if metadata_only else tuple(item.data for item in request.items),
                   messages=json.dumps(request.conversation) if request.conversation is not None else None)


def _in_client_terms(exc: Unavailable, items: tuple[MediaBytes, ...]) -> Unavailable:
    """A stage names the item it could not get by its own field, ``image_layouts[i]`` (the i-th layout of its
    modality); the client sent it as that item's ``field`` (``items``: the client's item of each layout, in order: a
    video's parts each name it)."""
    name, _, index = exc.field.partition("[")
    for m in modalities():
        own = [item for item in items if item.modality == m.name]
        if name == m.layout_tensor and index[:-1].isdigit() and int(index[:-1]) < len(own):
            return type(exc)(exc.problem, own[int(index[:-1])].field)
    return exc


def run_options(params: dict) -> tuple[bool | None, bool, bool | None]:
    """``Orchestrator.run``'s options from a request's parameters: metadata-only, encode, demand-aware (INVALID_ARG
    naming a parameter that is not a bool)."""
    return (_bool_parameter(params, METADATA_ONLY_PARAMETER), _bool_parameter(params, ENCODE_PARAMETER) is not False,
            _bool_parameter(params, DEMAND_AWARE_PARAMETER))


def _bool_parameter(params: dict, name: str) -> bool | None:
    value = params.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"parameters.{name}", f"expected a bool, got {value!r}")
    return value


def _merge(timings: dict, stage: dict | None) -> None:
    """A stage's timings into the request's; ``media_ms`` adds up over stages (prefill and decode)."""
    for key, value in (stage or {}).items():
        timings[key] = round(timings.get(key, 0) + value, 3) if key == "media_ms" else value


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 3)


__all__ = ["Orchestrator", "StageClient", "Identity", "run_options"]
