"""Log probabilities end to end without servers: vLLM's per-step dicts (built by vLLM's own code) -> the generate
interface's entries (``backend.engine.logprobs``) -> the responses (``Chunker``: each carries its tokens' entries)
-> the orchestrator's relay (E/P/D: decode's, never prefill's) -> OpenAI's shapes (``frontend.openai.logprobs``),
compared with what vLLM's own OpenAI server builds from the same dicts."""
from __future__ import annotations

import asyncio
import functools
import json
import types

import pytest

from backend.engine.logprobs import FLOOR, token_entries
from backend.engine.serving import stream_generation
from backend.request.generate import GenerateRequest, RawGenerateInputs, RequestLimits
from frontend.openai import logprobs as shapes
from orchestrator.core import Identity, Orchestrator
from tests.fakes import FakeEngine, FakeSink, FakeStages

VOCAB = ["a", " b", "c", "é", " dog", "!", "x", "y"]
LOGPROBS = [-0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, float("-inf")]  # token id i has LOGPROBS[i], rank i + 1


def _step(sampled: int, k: int) -> dict:
    """One position's dict as vLLM's logprobs processor makes it (``append_logprobs_for_next_position``): the sampled
    token, then the top k (the sampler's order)."""
    from vllm.logprobs import append_logprobs_for_next_position

    top = list(range(len(VOCAB))) if k == -1 else list(range(k))
    ids = [sampled, *top]
    out: list = []
    append_logprobs_for_next_position(out, ids, [LOGPROBS[i] for i in ids], [VOCAB[i] for i in ids], sampled + 1, k)
    return out[0]


CASES = {  # (sampled token ids, k)
    "greedy": ([0, 0, 0], 3),
    "sampled second": ([1, 0], 3),
    "sampled outside the top k": ([4, 7], 2),
    "sampled alone": ([3, 1], 0),
    "whole vocabulary": ([2], -1),
}


def _entries(tokens, k):
    return token_entries(tokens, [_step(t, k) for t in tokens], k, decode=lambda t: f"<{t}>")


def test_entries_carry_the_sampled_token_and_the_top_k_by_rank():
    [entry] = _entries([4], 2)
    assert entry == {"token_id": 4, "token": " dog", "logprob": -2.5, "rank": 5, "top_logprobs": [
        {"token_id": 0, "token": "a", "logprob": -0.5}, {"token_id": 1, "token": " b", "logprob": -1.0}]}
    [entry] = _entries([1], 3)  # sampled among the top k: listed once, at its rank
    assert [t["token_id"] for t in entry["top_logprobs"]] == [0, 1, 2] and entry["rank"] == 2
    assert _entries([3], 0)[0]["top_logprobs"] == []
    assert [t["token_id"] for t in _entries([2], -1)[0]["top_logprobs"]] == list(range(len(VOCAB)))
    assert _entries([2], -1)[0]["top_logprobs"][-1]["logprob"] == FLOOR  # no infinity in the JSON
    json.dumps(_entries([7], 2), allow_nan=False)


def test_a_token_without_a_decoded_text_or_logprobs_is_decoded_and_floored():
    step = _step(5, 1)
    step[5].decoded_token = None
    [decoded, missing] = token_entries([5, 6], [step, None], 1, decode=lambda t: f"<{t}>")
    assert decoded["token"] == "<5>" and decoded["logprob"] == -3.0
    assert missing == {"token_id": 6, "token": "<6>", "logprob": FLOOR, "rank": None, "top_logprobs": []}
    with pytest.raises(ValueError, match="2 tokens but logprobs for 1"):
        token_entries([5, 6], [step], 1, decode=str)


def _vllm_server(kind: str):
    """vLLM's own OpenAI server code (0.32) that turns the dicts into OpenAI's shapes, on a stand-in ``self``."""
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat as Serving
    else:
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion as Serving
    server = types.SimpleNamespace(return_tokens_as_token_ids=False, _get_decoded_token=Serving._get_decoded_token)
    if kind == "chat":
        server._get_top_logprobs = functools.partial(Serving._get_top_logprobs, server)
        return functools.partial(Serving._create_chat_logprobs, server)
    return functools.partial(Serving._create_completion_logprobs, server)


@pytest.mark.parametrize("case", list(CASES))
def test_chat_logprobs_are_what_vllms_server_answers(case):
    tokens, k = CASES[case]
    want = _vllm_server("chat")(token_ids=tokens, top_logprobs=[_step(t, k) for t in tokens], tokenizer=None,
                                num_output_top_logprobs=k).model_dump()
    assert shapes.chat(_entries(tokens, k)) == {**want, "refusal": None}
    assert shapes.chat(_entries([3], 1))["content"][0]["bytes"] == [0xC3, 0xA9]


@pytest.mark.parametrize("case", list(CASES))
def test_completion_logprobs_are_what_vllms_server_answers(case):
    tokens, k = CASES[case]
    want = _vllm_server("completion")(token_ids=tokens, top_logprobs=[_step(t, k) for t in tokens], tokenizer=None,
                                      num_output_top_logprobs=k, initial_text_offset=7).model_dump()
    assert shapes.completion(_entries(tokens, k), offset=7) == want
    assert shapes.text_length(_entries(tokens, k)) == sum(len(VOCAB[t]) for t in tokens)


def _request(stream: bool, logprobs: bool, exclude: bool = True) -> GenerateRequest:
    return GenerateRequest(prompt="Q: ", conversation=None, items=(), sampling={"logprobs": 2} if logprobs else {},
                           stream=stream, exclude_input_in_output=exclude)


def _sent(engine, request, interval=0.0):
    sink = FakeSink()
    asyncio.run(stream_generation(engine, request, sink, request_id="r", interval=interval))
    return [chunk for chunk, _ in sink.chunks]


def test_each_streamed_response_carries_its_own_tokens_entries():
    chunks = _sent(FakeEngine(pieces=["He", "", "llo", "!"]), _request(stream=True, logprobs=True))
    # the step that added no text yet goes with the next response's tokens
    assert [(c.text_output, [e["step"] for e in c.logprobs]) for c in chunks] == [("He", [0]), ("llo", [1, 2]),
                                                                                 ("!", [3])]


def test_merged_steps_carry_every_step_s_entries_and_the_whole_answer_all():
    chunks = _sent(FakeEngine(pieces=list("abcdef"), step_delay=0.01), _request(stream=True, logprobs=True), 0.025)
    assert 2 <= len(chunks) < 6
    assert [e["token"] for c in chunks for e in c.logprobs] == list("abcdef")
    assert all("".join(e["token"] for e in c.logprobs) == c.text_output for c in chunks)
    [whole] = _sent(FakeEngine(), _request(stream=False, logprobs=True, exclude=False))
    assert whole.text_output == "Q: Hello!" and [e["token"] for e in whole.logprobs] == ["Hel", "lo", "!"]


def test_no_logprobs_unless_asked():
    assert all(c.logprobs is None for c in _sent(FakeEngine(), _request(stream=True, logprobs=False)))


def test_e_p_d_relays_decode_s_entries_and_not_prefill_s_token():
    from backend.protocol.stages import Disaggregation

    stages, sink = FakeStages(pieces=("a", "b", "c")), FakeSink()
    raw = RawGenerateInputs(prompt="x", images=(b"A",), stream=True,
                            sampling='{"max_tokens": 3, "temperature": 0, "logprobs": 3}')
    asyncio.run(Orchestrator(stages, Identity("m", "{}"), RequestLimits(), Disaggregation.E_P_D).run(raw, sink))
    prefill, decode = stages.generated
    assert json.loads(prefill.sampling)["logprobs"] == 3  # prefill's engine checks the value first
    assert decode.sampling == raw.sampling
    entries = [e for chunk, _ in sink.chunks for e in chunk.logprobs]
    assert entries == [{"token": t, "stage": "decode"} for t in "abc"]


def _events(body: dict, pieces: list) -> list[dict]:
    """The endpoint's SSE documents for a stream of generate responses (``frontend.openai.app.Piece``)."""
    from frontend.openai import app, translate

    call = (translate.chat_call if "messages" in body else translate.completion_call)(body, {"llm"})

    async def collect():
        async def rest():
            for piece in pieces:
                yield 0, piece  # (choice, piece): one choice
        responses = rest()
        head = await responses.__anext__()
        answered = []
        writes = [line async for line in app._events(call.choices(), responses, head, lambda: answered.append(1))]
        assert answered == [1]  # counted once, after the last write
        return writes

    events = [e for write in asyncio.run(collect()) for e in write.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_the_endpoint_streams_each_chunk_with_its_tokens_logprobs():
    from frontend.openai.app import Piece

    he, llo = _entries([0], 1), _entries([1, 4], 1)  # "a", then " b" and " dog"
    pieces = [Piece("a", None, None, he), Piece(" b dog", None, None, llo), Piece("", "length", (3, 3), []),
              Piece("", None, None, None, final=True)]  # Triton's empty final response
    chat = _events({"model": "llm", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "logprobs": True, "top_logprobs": 1}, pieces)
    assert [c["choices"][0]["logprobs"] for c in chat] == [None, shapes.chat(he), shapes.chat(llo), shapes.chat([])]
    assert [c["choices"][0]["delta"] for c in chat[:2]] == [{"role": "assistant", "content": ""}, {"content": "a"}]
    text = _events({"model": "llm", "prompt": "hi", "stream": True, "logprobs": 1}, pieces)
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in text] == [[0], [1, 3], []]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in text] == [["a"], [" b", " dog"], []]
