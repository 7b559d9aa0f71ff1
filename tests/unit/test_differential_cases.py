"""The differential harness's generator (``tests.differential``): the same cases for the same seed, the issue's ranges
covered and the topologies' limits kept, media that decode to what their specs say, and the field an invalid case's
refusal must name."""
from __future__ import annotations

import io
import json

import pytest

from tests.differential import media
from tests.differential.cases import Case, IMAGE_FORMATS, INVALID_KINDS, Item, generate_all
from tests.differential.families import FAMILIES
from tests.differential.invalid import SPOILERS
from tests.differential.requests import grpc_request, openai_request

VISION, AUDIO = FAMILIES["qwen3_vl"], FAMILIES["qwen2_audio"]


def _items(cases, name):
    return [i for c in cases for i in c.items + c.extra if i.modality == name]


@pytest.fixture(scope="module")
def vision():
    return generate_all(VISION, 7, 600)


@pytest.fixture(scope="module")
def audio():
    return generate_all(AUDIO, 7, 400)


def test_the_same_seed_gives_the_same_cases_and_another_seed_others():
    first = [json.dumps(c.as_dict()) for c in generate_all(VISION, 7, 40)]
    assert first == [json.dumps(c.as_dict()) for c in generate_all(VISION, 7, 40)]
    assert first[12] == json.dumps(generate_all(VISION, 7, 0, only=[12])[0].as_dict())  # --only replays case 12
    assert len(set(first) & {json.dumps(c.as_dict()) for c in generate_all(VISION, 8, 40)}) < 4


def test_images_cover_the_ranges(vision):
    images = [i.spec for i in _items(vision, "image")]
    sides = [s for i in images for s in (i["w"], i["h"])]
    assert min(sides) == 28 and 900 < max(sides) <= 1024
    ratios = [max(i["w"], i["h"]) / min(i["w"], i["h"]) for i in images]
    assert max(ratios) > 12 and max(ratios) <= 20.5
    assert {i["fmt"] for i in images} == set(IMAGE_FORMATS)
    assert {i["mode"] for i in images} == {"RGB", "L", "RGBA", "P", "LA"}
    assert sum(max(i["w"], i["h"]) <= 192 for i in images) > 0.7 * len(images)  # weighted to small ones


def test_videos_cover_the_ranges(vision):
    videos = [i.spec for i in _items(vision, "video")]
    assert min(v["frames"] for v in videos) == 1 and max(v["frames"] for v in videos) >= 30
    assert max(v["frames"] for v in videos) <= 32
    assert {v["fps"] for v in videos} == set(range(1, 31))
    assert {v["codec"] for v in videos} == {"mp4v", "h264"}
    assert all(v["w"] % 2 == 0 and v["h"] % 2 == 0 for v in videos)


def test_audio_covers_the_ranges(audio):
    clips = [i.spec for i in _items(audio, "audio")]
    seconds = [c["seconds"] for c in clips]
    assert 0.1 <= min(seconds) < 0.3 and 30 < max(seconds) <= 40
    assert {c["rate"] for c in clips} >= {8_000, 48_000} and {c["channels"] for c in clips} == {1, 2}
    assert {i.form for c in audio for i in c.items} == {"item", "url", "data"}


@pytest.mark.parametrize("fam", list(FAMILIES.values()), ids=list(FAMILIES))
def test_shapes_and_counts(fam):
    cases = generate_all(fam, 3, 300)
    assert {c.kind for c in cases} == {"text", "prompt", "chat"}
    assert any(sum(t["role"] == "user" for t in c.turns) == 3 for c in cases)  # multi-turn chats
    assert any(c.kind == "chat" and not c.items for c in cases)  # text-only chats
    for name, limit in fam.limits.items():
        counts = {sum(i.modality == name for i in c.items) for c in cases if c.invalid is None}
        assert counts == set(range(limit + 1)), (name, counts)
    assert all(i.modality in fam.modalities for c in cases for i in c.items + c.extra)
    assert 0.08 < sum(c.invalid is not None for c in cases) / len(cases) < 0.25


def test_every_invalid_kind_is_generated_and_named():
    cases = generate_all(VISION, 1, 700) + generate_all(AUDIO, 1, 300)
    assert set(SPOILERS) == set(INVALID_KINDS)
    assert {c.invalid for c in cases} - {None} == set(INVALID_KINDS)
    for case in cases:
        if case.invalid:
            assert grpc_request(case).expect, case.shape()
            built = openai_request(case)
            assert built is None or built.expect, case.shape()


def test_the_family_limits_are_the_topologies():
    from backend.deploy.local_server import ROOT
    from backend.deploy.topology import load

    for fam in FAMILIES.values():
        limits = load(ROOT / "topologies" / fam.topology, "cpu").limits
        assert fam.limits == {name: limits[f"max_{name}s"] for name in fam.modalities}


def test_media_decode_to_their_specs():
    import soundfile
    from PIL import Image

    from clients.videos import opencv_frames

    for mode, fmt in (("P", "GIF"), ("LA", "WEBP"), ("L", "JPEG"), ("RGBA", "BMP"), ("RGB", "PNG")):
        picture = Image.open(io.BytesIO(media.image({"w": 300, "h": 28, "fmt": fmt, "mode": mode, "seed": 1})))
        assert picture.size == (300, 28) and picture.format == fmt
    for codec in ("mp4v", "h264"):
        frames = opencv_frames(media.video({"w": 48, "h": 64, "frames": 5, "fps": 3, "codec": codec, "seed": 2}))
        assert frames.shape == (5, 64, 48, 3), codec
    data, rate = soundfile.read(io.BytesIO(media.audio({"seconds": 0.5, "rate": 22_050, "channels": 2, "fmt": "FLAC",
                                                         "seed": 3})))
    assert rate == 22_050 and data.shape == (11_025, 2)
    spec = {"w": 64, "h": 64, "fmt": "PNG", "mode": "RGB"}
    assert media.image({**spec, "seed": 1}) == media.image({**spec, "seed": 1}) != media.image({**spec, "seed": 2})


def _chat(*parts, items=(), invalid=None, **kw) -> Case:
    return Case("qwen3_vl", 0, 0, "chat", items=list(items), invalid=invalid,
                turns=[{"role": "user", "parts": list(parts)}], sampling={"temperature": 0.0, "max_tokens": 2}, **kw)


IMG = {"w": 32, "h": 32, "fmt": "PNG", "mode": "RGB", "seed": 0}


@pytest.mark.parametrize("case, grpc_field, openai_field", [
    (_chat({"item": 0}, {"item": 1}, items=[Item("image", IMG), Item("image", IMG, broken="truncated")],
           invalid="broken_media"), "image[1]", "messages[0].content[1].image_url"),
    (_chat({"text": "x"}, {"raw": {"type": "picture"}}, invalid="unknown_part"), "messages[0].content[1].type",
     "messages[0].content[1].type"),
    (_chat({"item": 0}, {"raw": {"type": "image"}}, items=[Item("image", IMG)], invalid="missing_item"),
     "messages[0].content[1]", "messages[0].content[1]"),
    (_chat({"text": "x"}, extra=[Item("video", {"w": 32, "h": 32, "frames": 2, "fps": 2, "codec": "mp4v", "seed": 0})],
           invalid="unreferenced_item"), "video", None),
    (_chat({"item": 0}, {"item": 1}, {"item": 2}, items=[Item("video", {"w": 32, "h": 32, "frames": 2, "fps": 2,
                                                                        "codec": "mp4v", "seed": i}, "url")
                                                         for i in range(3)], invalid="too_many"), "messages", "messages"),
    (Case("qwen3_vl", 0, 0, "prompt", items=[Item("image", IMG)], invalid="placeholder_mismatch",
          prompt="<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>x"), "text_input",
     None),  # a video placeholder and no video
    (Case("qwen3_vl", 0, 0, "prompt", items=[Item("image", IMG)], invalid="placeholder_mismatch",
          prompt="<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>x"), "image",
     None),
    (Case("qwen3_vl", 0, 0, "text", prompt="<|vision_start|><|image_pad|><|vision_end|>x",
          invalid="placeholder_mismatch"), "text_input", "text_input"),
    (_chat({"text": "x"}, invalid="bad_sampling"), None, None),
])
def test_the_field_an_invalid_case_names(case, grpc_field, openai_field):
    if case.invalid == "bad_sampling":
        case.sampling["top_p"] = 1.5
        grpc_field = openai_field = "sampling_parameters.top_p"
    assert grpc_request(case).expect == grpc_field
    built = openai_request(case)
    assert (built.expect if built else None) == openai_field
