"""E2E: the model families beside Qwen2-VL, each its tiny checkpoint (``devtools.tiny.families``) served by its
topology (``topologies/cpu-qwen2.5-vl.yaml``, ``cpu-qwen3-vl.yaml``: llm, epd, epd_disagg) in one real tritonserver
per family. ``epd`` (E+PD) and ``epd_disagg`` (E/P/D) give ``llm``'s tokens on images of several sizes (Qwen2.5-VL:
several attention windows), videos of several frame rates (Qwen2.5-VL: other ``second_per_grid_ts``; Qwen3-VL: other
``<t seconds>`` in the prompt), an image and a video in one request, and several turns; the video timing in the layout
is what the engine uses (a wrong one changes the answer); a layout of another width is refused naming the field; pd,
prefill and decode decode no media."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from backend.deploy.local_server import ROOT, TritonServer, VENV
from backend.protocol.generate import GenerateInputs
from backend.triton.counter_batch import CounterBatch
from clients.triton_client import GenerateError, generate
from devtools.tiny.families import DEFAULT_OUT, build_family
from tests.e2e.conftest import _shm, assert_same_answer, metric, settled_orphans
from tests.images import image_bytes
from tests.videos import make_video

pytestmark = pytest.mark.e2e

FAMILIES = {"qwen2_5_vl": "cpu-qwen2.5-vl.yaml", "qwen3_vl": "cpu-qwen3-vl.yaml"}
GREEDY = {"temperature": 0.0, "max_tokens": 8}
CHAT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n<|im_start|>assistant\n"
I, V = {"type": "image"}, {"type": "video"}
# (width, height, frames, fps): sampled at 2 fps -> 2.0, 1.6 (the frame count floored to an even one) and 1.0 fps
CLIPS = [(160, 120, 45, 15), (96, 160, 30, 12), (64, 64, 8, 1)]


def vid(i: int) -> bytes:
    w, h, frames, fps = CLIPS[i]
    return make_video(w, h, frames=frames, fps=fps, seed=300 + i)


def user(*parts, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CASES = {
    "image_landscape": dict(messages=user(I), images=[image_bytes(200, 150, seed=1)]),
    "image_small": dict(messages=user(I), images=[image_bytes(56, 48, seed=2)]),
    "image_portrait": dict(messages=user(I), images=[image_bytes(90, 160, seed=3)], stream=False),
    "video_2fps": dict(messages=user(V, text="What happens?"), videos=[vid(0)]),
    "video_1.6fps": dict(messages=user(V, text="What happens?"), videos=[vid(1)]),
    "video_1fps": dict(prompt=CHAT, videos=[vid(2)]),
    "image_and_video": dict(messages=user(I, V, text="Both?"), images=[image_bytes(120, 80, seed=4)], videos=[vid(1)]),
    # issue 35: Qwen3-VL's loader leaves the first to the processor, samples the second (IndexError once batched)
    "two_videos": dict(messages=user(V, V, text="Compare."), videos=[make_video(64, 48, frames=4, fps=4, seed=310),
                                                                     make_video(48, 64, frames=6, fps=4, seed=311)]),
    "multi_turn": dict(messages=[
        {"role": "user", "content": [V, {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, I]}],
        images=[image_bytes(112, 112, seed=5)], videos=[vid(0)]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family name, its running tritonserver): ``family_server`` of each family."""
    yield from family_server(request.param, FAMILIES[request.param], tmp_path_factory)


def family_server(name: str, topology: str, tmp_path_factory):
    """Yield (``name``, its running tritonserver): the family's tiny checkpoint (built if missing) served by
    ``topologies/<topology>`` through ``backend.deploy.local_server``, as users start it; checked for stragglers and
    leaked /dev/shm entries after the stop."""
    build_family(name, ROOT / DEFAULT_OUT[name])
    argv = [str(VENV / "bin" / "python"), "-m", "backend.deploy.local_server", "--topology",
            str(ROOT / "topologies" / topology)]
    before = _shm()
    # the ports: the harness's (HTTP_PORT, GRPC_PORT, METRICS_PORT in the launcher's environment)
    server = TritonServer(env=dict(os.environ), argv=argv, log_path=tmp_path_factory.mktemp(name) / "server.log")
    with server:
        yield name, server
    assert not server.stragglers and not server.leftover_shm, (server.stragglers, server.leftover_shm)
    assert not (left := settled_orphans(before)), left


def ask(server, model: str, **inputs):
    inputs.setdefault("sampling", GREEDY)
    return generate(server.grpc_url, model, GenerateInputs(**inputs), timeout=300)


@pytest.fixture(scope="module")
def baseline(family):
    return {name: ask(family[1], "llm", **case) for name, case in CASES.items()}


def test_the_baseline_depends_on_the_media(baseline):
    texts = [baseline[name].text for name in ("image_landscape", "image_small", "image_portrait")]
    assert len(set(texts)) == 3, texts
    assert len({baseline[name].text for name in ("video_2fps", "video_1.6fps", "video_1fps")}) == 3


@pytest.mark.parametrize("model", ["epd", "epd_disagg"])
def test_epd_returns_the_baseline_tokens(family, baseline, model):
    for name, case in CASES.items():
        got = ask(family[1], model, **case)
        assert got.timings["items"] == len(case.get("images", ())) + len(case.get("videos", ())), name  # encoded
        if case.get("videos"):  # each family's topology splits each video across 2 encoders
            assert got.timings.get("parts", 0) == got.timings["items"] + len(case["videos"]), (name, got.timings)
        assert_same_answer(got, baseline[name])


@pytest.mark.parametrize("model", ["epd", "epd_disagg"])
def test_video_requests_sent_together_return_the_baseline_tokens(family, baseline, model):
    """The video cases at once, so that the encoders' batcher may put videos of different requests (and frame counts,
    sizes, rates) in one batch: each answer is still llm's."""
    from concurrent.futures import ThreadPoolExecutor

    names = [name for name, case in CASES.items() if case.get("videos")]
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: ask(family[1], model, **CASES[name]), names))
    for name, got in zip(names, answers):
        assert_same_answer(got, baseline[name])


def _encode(server, data: bytes, modality: str = "video") -> dict:
    """One item straight to the encoder model: its layout document."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        item, kind = grpcclient.InferInput("image", [1, 1], "BYTES"), grpcclient.InferInput("modality", [1, 1], "BYTES")
        item.set_data_from_numpy(np.array([[data]], dtype=np.object_))
        kind.set_data_from_numpy(np.array([[modality.encode()]], dtype=np.object_))
        result = client.infer("encoder", [item, kind], parameters={"epd_error_codes": True})
        return json.loads(result.as_numpy("layout").reshape(-1)[0].decode())
    finally:
        client.close()


def _timing_changed(doc: dict) -> dict:
    """``doc`` with a wrong video timing: Qwen2.5-VL's second_per_grid_ts tripled, Qwen3-VL's timestamps 7 s later."""
    video = dict(doc["video"])
    if "second_per_grid_ts" in video:
        video["second_per_grid_ts"] *= 3
    else:
        video["timestamps"] = [t + 7 for t in video["timestamps"]]
    return {**doc, "video": video}


def test_the_layout_s_video_timing_is_what_the_engine_uses(family, baseline):
    """pd given the encoder's layout of a video answers as llm does; the same embeddings with a wrong timing do not."""
    name, server = family
    doc = _encode(server, vid(1))
    assert ("second_per_grid_ts" in doc["video"]) == (name == "qwen2_5_vl")
    assert ("timestamps" in doc["video"]) == (name == "qwen3_vl")
    want = ask(server, "llm", prompt=CHAT, videos=[vid(1)])
    right = ask(server, "pd", prompt=CHAT, video_layouts=[json.dumps(doc)])
    wrong = ask(server, "pd", prompt=CHAT, video_layouts=[json.dumps(_timing_changed(_encode(server, vid(1))))])
    assert_same_answer(right, want)
    assert wrong.text != want.text


def test_embeddings_of_another_width_are_refused_naming_the_field(family):
    name, server = family
    doc = _encode(server, image_bytes(64, 64, seed=6), "image")
    tokens, width = doc["shape"]
    assert width == (384 if name == "qwen3_vl" else 128)  # Qwen3-VL: 128 x (1 + 2 DeepStack levels)
    narrow = {**doc, "shape": [tokens, 64], "handle": {**doc["handle"], "nbytes": tokens * 64 * 4}}
    prompt = CHAT.replace("<|video_pad|>", "<|image_pad|>")
    for model in ("pd", "prefill"):
        with pytest.raises(GenerateError) as info:
            ask(server, model, prompt=prompt, image_layouts=[json.dumps(narrow)])
        assert info.value.message.startswith("image_layouts[0].shape: embeddings are 64 wide, this consumer's model "
                                             f"takes {width}-wide"), info.value.message


def test_the_consumers_decode_no_media(family, baseline):
    """After every case through epd and epd_disagg (metadata-only on), pd, prefill and decode have decoded nothing,
    while llm decoded every item."""
    import time

    server = family[1]
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # the counts handed to Triton in batches are in
    for model in ("pd", "prefill", "decode"):
        assert metric(server, "epd_media_decodes_total", model=model) == 0, model
    items = sum(len(c.get("images", ())) + len(c.get("videos", ())) for c in CASES.values())
    assert metric(server, "epd_media_decodes_total", model="llm") >= items


def test_differential_cases_answer_as_llm(family):
    """The differential harness's bounded run (``tests.differential.bounded``) on this family's server."""
    from tests.differential import bounded

    bounded.check(family[1].grpc_url, family[0])
