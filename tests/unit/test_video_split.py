"""A video split across encoders (``video_split``): the encoder's part i/n (``epd_part``) is the matching rows of the
whole video's embeddings on the tiny checkpoint, the layout's ``video.part``, the consumer joining parts into one item
and one grid row (and refusing parts that do not make up their video), the orchestrator asking for the parts and
naming the client's item in errors, and the topology setting's rendering."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from backend.encode.encoder import VideoPart, VisionEncoder
from backend.encode.service import EncodeJob, EncoderService
from backend.protocol.errors import InvalidInput, Unavailable
from backend.protocol.generate import parse_part, part_range
from backend.protocol.layout import LayoutMetadata, NixlHandle, VideoLayout, content_key
from backend.request.generate import LayoutMedia, RawGenerateInputs, RequestLimits, parse_generate_request
from backend.request.media import MediaLimits, decode_counter
from backend.request.video import decode_video
from backend.transfer.engine_inputs import media_grids
from tests.bounds import BATCH_BOUND
from tests.videos import make_video

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-vl"
LIMITS = MediaLimits(video_processor="Qwen2VLVideoProcessor")


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder.load(MODEL)


@pytest.fixture(scope="module")
def video():
    decoded = decode_video(make_video(160, 120, frames=75, fps=15, seed=11), "video[0]", LIMITS)
    assert len(decoded.frames) == 10  # 5 s at 2 fps: 5 temporal patches
    return decoded


def _rows(item, first, stop):
    t, h, w = item.image_grid_thw
    per_t = h * w // 4  # tokens per temporal patch after the 2x2 merger
    return item.embeddings[first * per_t: stop * per_t]


@pytest.mark.parametrize("count", [2, 3, 5])
def test_each_part_is_the_matching_rows_of_the_whole_video(encoder, video, count):
    whole = encoder.encode([video])[0]
    parts = encoder.encode([VideoPart(video, (i, count)) for i in range(count)])
    assert whole.image_grid_thw == (5, 6, 8) and whole.part is None
    for i, part in enumerate(parts):
        first, stop = part_range((i, count), 5)
        assert part.image_grid_thw == (stop - first, 6, 8) and part.part == (first, 5)
        assert torch.equal(part.embeddings, _rows(whole, first, stop))
        assert part.media() == VideoLayout((stop - first, 6, 8), (first, 5))
    assert torch.equal(torch.cat([p.embeddings for p in parts]), whole.embeddings)


def test_preprocessing_a_part_s_frames_alone_gives_the_rows_of_the_whole_preprocessing(encoder, video):
    """Why the encoder preprocesses only a part's frames (``cap_pixels_per_frame`` off): the same pixels, exactly,
    also where the last temporal patch is padded (an odd frame count)."""
    vp = encoder.video_processor
    for frames in (video.frames, video.frames[:9]):
        whole = vp(videos=[frames], return_tensors="pt")
        t, h, w = whole["video_grid_thw"][0].tolist()
        for first, stop in ((0, 2), (2, t)):
            alone = vp(videos=[frames[first * 2: stop * 2]], return_tensors="pt")
            assert alone["video_grid_thw"][0].tolist() == [stop - first, h, w]
            assert torch.equal(alone["pixel_values_videos"], whole["pixel_values_videos"][first * h * w: stop * h * w])


def test_frames_held_as_tensors_are_preprocessed_apart_and_give_the_array_s_embeddings(encoder, video):
    """NVDEC's frames are a CUDA tensor, preprocessed where they are (``_by_frames_device``); here a CPU tensor
    stands in for it (CI has no GPU; tests/component/test_nvdec_gpu.py does it on CUDA): in a batch with an array
    video, a part of the tensor video and an image, each item's embeddings are what it gets alone (within the batch
    bound: the image's rows in a batch of four moved by ulps on an AVX-512 machine)."""
    from PIL import Image

    held = dataclasses.replace(video, frames=torch.from_numpy(video.frames.copy()))
    image = Image.new("RGB", (56, 56), (10, 200, 30))
    batch = [held, video, VideoPart(held, (1, 2)), image]
    got = encoder.encode(batch)
    alone = [encoder.encode([item])[0] for item in (video, video, VideoPart(video, (1, 2)), image)]
    for index, (g, want) in enumerate(zip(got, alone)):
        assert (g.modality, g.image_grid_thw, g.part) == (want.modality, want.image_grid_thw, want.part), index
        torch.testing.assert_close(g.embeddings, want.embeddings, **BATCH_BOUND, msg=f"item {index}")


def test_keeps_size_says_which_frames_the_processor_does_not_resize(encoder, video):
    """Where NVDEC's frames may be preprocessed on the GPU (``VisionEncoder.keeps_size``): the tiny checkpoint's
    processor keeps 112x112 and 56x84 (multiples of 28 in its pixel budget), resizes 448x448 and 640x360; the
    frames of a kept size come out of the processor with exactly their size."""
    assert [encoder.keeps_size(s) for s in ((2, 112, 112, 3), (30, 56, 84, 3), (2, 448, 448, 3), (2, 360, 640, 3))] \
        == [True, True, False, False]
    frames = video.frames[:, :112, :112]
    _, h, w = encoder.video_processor(videos=[frames], return_tensors="pt")["video_grid_thw"][0].tolist()
    assert (h * 14, w * 14) == (112, 112)


def test_a_processor_that_sizes_frames_by_their_count_is_cut_after_preprocessing(encoder, video):
    import copy

    class Recording:
        """The checkpoint's video processor with ``cap_pixels_per_frame`` on, counting the frames it is given."""

        def __init__(self, processor):
            self.processor, self.frames = copy.copy(processor), []
            self.processor.cap_pixels_per_frame = True

        def __getattr__(self, name):
            return getattr(self.processor, name)

        def __call__(self, videos, **kwargs):
            self.frames += [len(v) for v in videos]
            return self.processor(videos=videos, **kwargs)

    capped = copy.copy(encoder)
    capped.video_processor = Recording(encoder.video_processor)
    whole = capped.encode([video])[0]
    part = capped.encode([VideoPart(video, (1, 2))])[0]
    assert capped.video_processor.frames == [10, 10]  # all frames preprocessed for the part too
    assert part.image_grid_thw == (3, 6, 8) and part.part == (2, 5) and torch.equal(part.embeddings, _rows(whole, 2, 5))


def test_part_parameters_are_checked():
    assert parse_part("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(InvalidInput) as info:
            parse_part(bad)
        assert info.value.field == "parameters.epd_part"


def test_the_service_keys_parts_apart_answers_an_empty_part_with_nothing_and_refuses_image_parts(encoder):
    from tests.unit.test_encoder_cache import RecordingPool

    pool = RecordingPool()
    service = EncoderService(encoder, pool, LIMITS, "", cache_bytes=8 << 20)
    clip = make_video(64, 64, frames=8, fps=4, seed=12)  # 4 frames: 2 temporal patches
    keys = {content_key(clip, "", encoder.identity, part) for part in (None, (0, 2), (1, 2), (0, 3))}
    assert len(keys) == 4  # the whole and each part are items of their own (the cache never mixes them)
    results = service.run([EncodeJob(0, clip, "w", modality="video"), EncodeJob(1, clip, "p0", modality="video", part=(0, 2)),
                           EncodeJob(2, clip, "e", modality="video", part=(0, 3)),
                           EncodeJob(3, b"x", "i", modality="image", part=(0, 2))], 4)
    whole = LayoutMetadata.from_json(results[0][0], "video_layouts[0]")
    part = LayoutMetadata.from_json(results[1][0], "video_layouts[0]")
    assert whole.media == VideoLayout((2, 4, 4)) and part.media == VideoLayout((1, 4, 4), (0, 2))
    assert results[2] == [""]  # part 0 of 3 of 2 temporal patches: [0, 0)
    assert isinstance(results[3], InvalidInput)
    again = service.run([EncodeJob(0, clip, "p1", modality="video", part=(1, 2)), EncodeJob(1, clip, "w2", modality="video")], 2)
    assert service.cache_hits == 1  # the whole video again; part 1 was encoded, not served from the whole's entry
    assert LayoutMetadata.from_json(again[0][0], "v").media == VideoLayout((1, 4, 4), (1, 2))
    assert len(pool.published) == 4  # no lease for the empty part
    before = decode_counter.count
    longer = make_video(64, 64, frames=16, fps=4, seed=13)  # 8 frames: 4 temporal patches
    both = service.run([EncodeJob(0, longer, "a", modality="video", part=(0, 2)),
                        EncodeJob(1, longer, "b", modality="video", part=(1, 2))], 2)
    assert decode_counter.count == before + 1  # two parts of one video in one batch: one decode
    assert [LayoutMetadata.from_json(r[0], "v").media.part for r in both] == [(0, 4), (2, 4)]


def _layout(grid, part=None, key="k") -> LayoutMetadata:
    handle = NixlHandle(agent_name="a", agent_metadata=b"m", descriptors=b"d", lease_id="ab",
                        nbytes=4 * 8 * grid[0] * grid[1] * grid[2] // 4, expires_at=1e12)
    return LayoutMetadata(key, "m", "float32", (grid[0] * grid[1] * grid[2] // 4, 8), handle, VideoLayout(grid, part))


def test_the_part_member_round_trips_and_is_checked():
    layout = _layout((2, 4, 4), (3, 5))
    doc = json.loads(layout.to_json())
    assert doc["video"] == {"grid_thw": [2, 4, 4], "part": [3, 5]}
    assert LayoutMetadata.from_json(layout.to_json(), "video_layouts[0]") == layout
    for bad in ([4, 5], [0], "x", [-1, 5]):
        doc["video"]["part"] = bad
        with pytest.raises(InvalidInput) as info:
            LayoutMetadata.from_json(json.dumps(doc), "video_layouts[1]")
        assert info.value.field == "video_layouts[1].video.part"


def test_consecutive_parts_are_one_grid_row_and_one_item_of_the_request():
    layouts = [_layout((2, 4, 4), (0, 5)), _layout((3, 4, 4), (2, 5)), _layout((1, 6, 6)), _layout((1, 2, 2), (0, 2)),
               _layout((1, 2, 2), (1, 2))]
    assert media_grids(layouts)["video"].tolist() == [[5, 4, 4], [1, 6, 6], [2, 2, 2]]
    raw = RawGenerateInputs(prompt="<|video_pad|> <|video_pad|> <|video_pad|>",
                            video_layouts=tuple(layout.to_json() for layout in layouts))
    request = parse_generate_request(raw, LayoutMedia("m"), RequestLimits(max_videos=3))
    assert request.items == tuple(layouts)  # flat again, in order
    with pytest.raises(InvalidInput, match="4 videos, over the per-request limit of 3"):
        parse_generate_request(replace_layouts(raw, layouts + [_layout((1, 6, 6))]), LayoutMedia("m"),
                               RequestLimits(max_videos=3))


def replace_layouts(raw, layouts):
    return dataclasses.replace(raw, video_layouts=tuple(layout.to_json() for layout in layouts))


@pytest.mark.parametrize("layouts, field, fragment", [
    ([_layout((2, 4, 4), (0, 5))], "video_layouts[0]", "stop at temporal patch 2 of 5"),
    ([_layout((2, 4, 4), (0, 5)), _layout((1, 6, 6))], "video_layouts[0]", "later parts are missing"),
    ([_layout((3, 4, 4), (2, 5)), _layout((2, 4, 4), (0, 5))], "video_layouts[0]", "follows no part"),
    ([_layout((2, 4, 4), (0, 5)), _layout((2, 4, 4), (3, 5))], "video_layouts[1]", r"does not continue video_layouts\[0\]"),
    ([_layout((2, 4, 4), (0, 5)), _layout((3, 4, 4), (2, 6))], "video_layouts[1]", "does not continue"),
    ([_layout((2, 4, 4), (0, 5)), _layout((3, 4, 6), (2, 5))], "video_layouts[1]", r"does not match video_layouts\[0\]"),
])
def test_parts_that_do_not_make_up_their_video_are_refused_naming_the_part(layouts, field, fragment):
    with pytest.raises(InvalidInput, match=fragment) as info:
        media_grids(layouts)
    assert info.value.field == field


def _run(stages, raw, split=2, **kw):
    from orchestrator.core import Identity, Orchestrator
    from tests.fakes import FakeSink

    sink = FakeSink()
    asyncio.run(Orchestrator(stages, Identity("m", "p"), RequestLimits(), video_split=split).run(raw, sink, **kw))
    return sink


def test_the_orchestrator_asks_for_every_part_at_once_and_sends_them_in_order():
    from tests.fakes import FakeStages

    raw = RawGenerateInputs(prompt="x", videos=(b"V1", b"V2"), images=(b"I",))
    stages = FakeStages(encode_delay=0.05)
    sink = _run(stages, raw, split=3)
    assert stages.peak == 7 and sorted(map(str, stages.parts)) == sorted(map(str, [None] + [(i, 3) for i in range(3)] * 2))
    [sent] = stages.generated
    assert len(sent.video_layouts) == 6 and len(sent.image_layouts) == 1
    order = [json.loads(text)["layout"] for text in sent.video_layouts]
    asked = [(stages.encoded[i][0], stages.parts[i]) for i in order]
    assert asked == [(b"V1", (0, 3)), (b"V1", (1, 3)), (b"V1", (2, 3)), (b"V2", (0, 3)), (b"V2", (1, 3)), (b"V2", (2, 3))]
    keys = {key for _, key in stages.encoded}
    assert len(keys) == 7 and content_key(b"V1", "p", "m", (1, 3)) in keys
    timings = sink.chunks[-1][0].timings
    assert timings["items"] == 3 and timings["parts"] == 7


def test_empty_parts_are_left_out_and_metadata_only_off_does_not_split():
    from tests.fakes import FakeStages

    class Short(FakeStages):
        async def encode(self, item, key, part=None):
            text = await super().encode(item, key, part)
            return "" if part == (0, 2) else text  # a video of one temporal patch: part 0 of 2 is empty

    stages = Short(encode_delay=0)
    _run(stages, RawGenerateInputs(prompt="x", videos=(b"V",)))
    assert stages.generated[0].video_layouts == ('{"layout": 1}',)
    stages = FakeStages(encode_delay=0)
    _run(stages, RawGenerateInputs(prompt="x", videos=(b"V",)), metadata_only=False)
    assert stages.parts == [None]


def test_a_stage_s_error_on_a_part_names_the_client_s_video():
    from tests.fakes import FakeStages

    class Lost(FakeStages):
        def generate(self, inputs, stage=None):
            raise Unavailable("embedding lease expired", "video_layouts[3]")

    raw = RawGenerateInputs(messages=json.dumps([{"role": "user", "content": [
        {"type": "video"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "?"}]}]),
        videos=(b"V1", b"V2"), images=(b"I",))
    sink = _run(Lost(encode_delay=0), raw)
    [error] = sink.errors
    assert error.field == "video[1]"  # layouts 0, 1: video[0]'s parts; 2, 3: video[1]'s


def test_the_topology_renders_video_split_for_the_orchestrators_and_no_queue_delay_for_the_encoder(tmp_path):
    from backend.deploy.render import render_files
    from backend.deploy.schema import TopologyError
    from backend.deploy.topology import load

    root = Path(__file__).resolve().parents[2]
    text = (root / "topologies" / "default.yaml").read_text().replace("checkpoint: ../", f"checkpoint: {root}/")
    (tmp_path / "split.yaml").write_text(text + "video_split: 2\n")
    files = render_files(load(tmp_path / "split.yaml"), tmp_path / "repo")
    for model in ("epd", "epd_disagg"):
        assert 'key: "video_split" value: { string_value: "2" }' in files[f"{model}/config.pbtxt"]
    assert "max_queue_delay_microseconds: 0\n" in files["encoder/config.pbtxt"]
    default = render_files(load(root / "topologies" / "default.yaml"), tmp_path / "repo")
    assert "video_split" not in default["epd/config.pbtxt"]
    assert "max_queue_delay_microseconds: 2000" in default["encoder/config.pbtxt"]
    (tmp_path / "bad.yaml").write_text(text + "video_split: 0\n")
    with pytest.raises(TopologyError, match="video_split: expected an integer from 1 to 16"):
        load(tmp_path / "bad.yaml")
