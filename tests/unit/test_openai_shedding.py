"""``frontend.openai.shedding``: after a model refuses a request for load, the endpoint answers that model's requests of
the same or lower priority itself for a window, and nothing else (``make_app`` over a scripted in-process backend)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from backend.engine.serving import ResponseChunk
from backend.protocol.errors import Overloaded
from frontend.openai.app import make_app
from frontend.openai.in_process import LocalBackend
from frontend.openai.shedding import EndpointRefusal, Shedding
from frontend.openai.translate import ApiError

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Model:
    """Refuses for load while ``full``, else answers; counts what reached it."""

    def __init__(self):
        self.full, self.reached = True, []

    async def __call__(self, raw, params, sink):
        self.reached.append(params.get("epd_priority", 0))
        if self.full:
            sink.send_error(Overloaded("stage pd is at its budget (16 in flight)", retry_after=0.4))
            return
        sink.send(ResponseChunk("ok", finish_reason="stop", num_input_tokens=2, num_output_tokens=1), final=True)


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def _post_all(model: Model, clock: Clock, bodies: list[dict], between: float = 0.0) -> list[httpx.Response]:
    async def run():
        app = make_app(LocalBackend("m", model), shedding=Shedding(0.05, clock))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            answers = []
            for body in bodies:
                answers.append(await client.post("/v1/chat/completions", json=body))
                clock.now += between
            return answers
    return asyncio.run(run())


def test_a_refusal_for_load_is_answered_here_for_its_priority_and_lower_ones_within_the_window():
    model, clock = Model(), Clock()
    low, high = {**BODY, "priority": 1}, {**BODY, "priority": 0}
    answers = _post_all(model, clock, [low, low, {**low, "priority": 3}, high])
    assert [a.status_code for a in answers] == [429, 429, 429, 429]
    assert model.reached == [1, 0]  # the second low and the priority-3 one were answered here; high asked the model
    here = answers[1]
    assert here.headers["Retry-After"] == "1" and here.json()["error"]["code"] == "overloaded"
    assert "answered by the endpoint: m refused a priority 1 request 0 ms ago" in here.json()["error"]["message"]


def test_after_the_window_the_model_is_asked_again_and_endpoint_refusals_open_no_window():
    model, clock = Model(), Clock()
    low = {**BODY, "priority": 1}
    answers = _post_all(model, clock, [low, low, low, low], between=0.03)  # t = 0, 30 (here), 60, 90 (here) ms
    assert [a.status_code for a in answers] == [429] * 4 and model.reached == [1, 1]
    model.full = False
    clock.now += 0.05
    assert _post_all(model, clock, [low])[0].status_code == 200


def test_other_errors_and_a_window_of_zero_shed_nothing_here():
    overloaded = ApiError(429, "overloaded: full", "rate_limit_error", code="overloaded", retry_after=1)
    shedding = Shedding(0.05, Clock())
    shedding.refused("m", 1, ApiError(400, "bad", param="messages"))
    shedding.check("m", 1)  # a 400 opens no window
    off = Shedding(0.0, Clock())
    off.refused("m", 1, overloaded)
    off.check("m", 1)  # off
    shedding.refused("m", 1, overloaded)
    with pytest.raises(EndpointRefusal):  # the same refusal with a window
        shedding.check("m", 1)
    shedding.check("other", 1)  # another model's requests are its own


def test_the_endpoint_refuses_before_it_reads_the_request_any_further():
    """Within the window a request is refused on its model and priority alone: its messages are not even checked
    (a body the translation would refuse with 400 gets the 429 here); after the window it gets its 400."""
    model, clock = Model(), Clock()
    low, broken = {**BODY, "priority": 1}, {**BODY, "priority": 1, "messages": "not a list"}
    answers = _post_all(model, clock, [low, broken], between=0.0)
    assert [a.status_code for a in answers] == [429, 429] and model.reached == [1]
    clock.now += 0.05
    assert _post_all(model, clock, [broken])[0].status_code == 400
