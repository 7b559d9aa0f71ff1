"""Fakes shared by the unit tests (never copied between test files)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from backend.engine.host import GenerationDelta
from backend.request.generate import GenerateRequest
from backend.engine.serving import Outcome, ResponseChunk


def render_chat(conversation) -> str:
    """A stand-in chat template: role, then text, with <image> for image parts."""
    out = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, list):
            content = "".join("<image>" if p["type"] == "image" else p["text"] for p in content)
        out.append(f"{message['role']}: {content}\n")
    return "".join(out) + "assistant: "


class FakeEngine:
    """Yields the given text pieces one per step (a request asking for ``logprobs``: one entry per step, its piece
    and step); records aborts. ``fail_with`` raises after ``fail_after`` steps
    (in the first ``failures`` requests; None: in every one)."""

    def __init__(self, pieces=("Hel", "lo", "!"), finish_reason="stop", num_input_tokens=7,
                 fail_with: BaseException | None = None, fail_after: int = 0, step_delay: float = 0.0,
                 failures: int | None = None, kv_transfer_params: dict | None = None):
        """``kv_transfer_params``: on the final delta, as a KV producer's (prefill's) engine returns them."""
        self.pieces, self.finish_reason, self.num_input_tokens = list(pieces), finish_reason, num_input_tokens
        self.kv_transfer_params = kv_transfer_params
        self.fail_with, self.fail_after, self.step_delay, self.failures = fail_with, fail_after, step_delay, failures
        self.aborted: list[str] = []
        self.steps_run = 0
        self.requests = 0

    def prompt_text(self, request: GenerateRequest) -> str:
        return request.prompt if request.prompt is not None else render_chat(request.conversation)

    async def generate(self, request: GenerateRequest, request_id: str):
        self.requests += 1
        failing = self.fail_with is not None and (self.failures is None or self.requests <= self.failures)
        for i, piece in enumerate(self.pieces):
            if failing and i == self.fail_after:
                raise self.fail_with
            if request_id in self.aborted:
                return
            await asyncio.sleep(self.step_delay)
            self.steps_run += 1
            last = i == len(self.pieces) - 1
            yield GenerationDelta(piece, self.num_input_tokens, i + 1, self.finish_reason if last else None,
                                  self.kv_transfer_params if last else None,
                                  logprobs=[{"token": piece, "step": i}] if "logprobs" in request.sampling else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@dataclass
class FakeSink:
    """Records what a Triton response sender would have been sent; cancels after ``cancel_after`` sends."""

    cancel_after: int | None = None
    chunks: list[tuple[ResponseChunk, bool]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    closed: int = 0

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self.chunks.append((chunk, final))

    def send_error(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def close(self) -> None:
        self.closed += 1

    @property
    def finals(self) -> int:
        return sum(final for _, final in self.chunks) + len(self.errors) + self.closed


@dataclass
class RecordingObserver:
    finished: list[tuple[Outcome, int]] = field(default_factory=list)

    retried: list[str] = field(default_factory=list)

    def request_finished(self, outcome: Outcome, num_output_tokens: int) -> None:
        self.finished.append((outcome, num_output_tokens))

    def request_retried(self, what: str) -> None:
        self.retried.append(what)


class FakeStages:
    """A ``StageClient``: encode returns a layout stand-in per item after ``encode_delay`` (recording the
    peak number of concurrent encodes); generate records what it was sent and streams ``pieces``."""

    def __init__(self, pieces=("a", "b"), encode_delay: float = 0.01, encode_error: BaseException | None = None,
                 fail_item: int | set[int] | None = None, generate_error: BaseException | None = None,
                 generate_failures: int = 0, fail_after_chunks: int = 0):
        """``fail_item``: the encode call(s), by order of arrival, that raise ``encode_error``. The first
        ``generate_failures`` generate calls raise ``generate_error`` after ``fail_after_chunks`` chunks."""
        self.pieces, self.encode_delay = list(pieces), encode_delay
        self.encode_error = encode_error
        self.fail_items = {fail_item} if isinstance(fail_item, int) else set(fail_item or ())
        self.generate_error, self.generate_failures, self.fail_after_chunks = generate_error, generate_failures, fail_after_chunks
        self.encoded: list[tuple[bytes, str]] = []
        self.parts: list = []  # the part asked for by each encode call (None: a whole item)
        self.generated = []
        self.stages_called = []
        self.aborted = 0
        self.active = self.peak = 0

    async def encode(self, item, key, part=None):
        index = len(self.encoded)
        self.encoded.append((item.data, key))
        self.parts.append(part)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.encode_delay)
            if self.encode_error is not None and index in self.fail_items:
                raise self.encode_error
            return f'{{"layout": {index}}}'
        finally:
            self.active -= 1

    async def generate(self, inputs, stage=None):
        from backend.engine.serving import ResponseChunk
        from backend.protocol.stages import Stage

        self.generated.append(inputs)
        self.stages_called.append(stage)
        failing = self.generate_error is not None and len(self.generated) <= self.generate_failures
        # asked for logprobs: each chunk carries one entry per piece, naming the stage that made it
        asked = "logprobs" in json.loads(inputs.sampling or "{}")
        if stage is Stage.PREFILL:
            yield ResponseChunk("", "length", kv_transfer_params={"remote_block_ids": [[1]], "do_remote_prefill": True},
                                timings={"transfer_ms": 1.0},
                                logprobs=[{"token": "p", "stage": "prefill"}] if asked else None)
            return
        done = False
        try:
            for i, piece in enumerate(self.pieces):
                if failing and i == self.fail_after_chunks:
                    raise self.generate_error
                last = i == len(self.pieces) - 1
                done = last
                entries = [{"token": piece, "stage": getattr(stage, "value", stage)}] if asked else None
                yield ResponseChunk(piece, "stop" if last else None, 5 if last else None, len(self.pieces) if last else None,
                                    logprobs=entries)
        finally:
            if not done:
                self.aborted += 1  # a real stage aborts its engine request here


class FakeLayoutResolver:
    """A ``MediaResolver`` for metadata-only requests (as ``LayoutMedia``, without the layout schema): a layout's
    text is the item; media bytes or URLs are refused."""

    def from_tensor(self, data, field, modality=None):
        from backend.protocol.errors import InvalidInput
        raise InvalidInput(field, "this model takes metadata-only media (image_layouts), not media bytes")

    def from_url(self, url, field, modality=None):
        from backend.protocol.errors import InvalidInput
        raise InvalidInput(field, "this model takes metadata-only media (image_layouts), not media URLs")

    def from_layout(self, text, field, modality=None):
        return text


class FakePull:
    """A ``prepare`` step standing in for the embedding pull: records the requests it saw, raises
    ``error`` on its first ``failures`` calls, else reports a transfer in ``timings``."""

    def __init__(self, error: BaseException | None = None, failures: int = 0):
        self.error, self.failures = error, failures
        self.seen: list[GenerateRequest] = []

    async def __call__(self, request: GenerateRequest) -> GenerateRequest:
        from dataclasses import replace

        self.seen.append(request)
        if self.error is not None and len(self.seen) <= self.failures:
            raise self.error
        return replace(request, items=(), media_embeds={"image": ("embeds", len(request.items))},
                       timings={"transfer_ms": 0.5, "transfer_bytes": 64 * len(request.items)})
