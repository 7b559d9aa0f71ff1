"""Videos: the request stage's decoding and limits (``backend.request.video``), chat parts and tensors of the video
modality, the layout's video block, the encoder's video path on the tiny checkpoint, and what the engine is given."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from backend.encode.encoder import EncodedItem, VisionEncoder
from backend.engine.host import multi_modal_data
from backend.protocol.errors import InvalidInput
from backend.protocol.layout import ImageLayout, LayoutMetadata, NixlHandle, VideoLayout
from backend.request.generate import DecodeMedia, EncodedMedia, GenerateRequest, RawGenerateInputs, RequestLimits, \
    parse_generate_request
from backend.request.media import MediaLimits, decode_counter
from backend.request.video import DecodedVideo, decode_video, read_video_url, video_processor_for
from backend.transfer.engine_inputs import media_fields, media_grids
from tests.images import image_bytes, make_image
from tests.videos import make_video

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-vl"
LIMITS = MediaLimits(video_processor="Qwen2VLVideoProcessor")


def test_the_tiny_checkpoint_s_video_processor_picks_vllm_s_qwen2_vl_loader():
    assert video_processor_for(MODEL) == "Qwen2VLVideoProcessor"


def test_a_video_decodes_to_frames_sampled_as_vllm_s_qwen2_vl_loader_does():
    before = decode_counter.count
    video = decode_video(make_video(160, 120, frames=45, fps=15), "video[0]", LIMITS)
    assert decode_counter.count == before + 1
    # 3 s at 2 fps: 6 frames, floored to a multiple of temporal_patch_size (2)
    assert video.frames.shape == (6, 120, 160, 3) and video.frames.dtype.name == "uint8"
    assert video.metadata["fps"] == 15 and video.metadata["total_num_frames"] == 45
    assert video.metadata["frames_indices"] == [0, 7, 15, 22, 30, 37]
    frames, meta = video.engine_item()
    assert frames is video.frames and meta is video.metadata


def test_base64_text_of_a_container_is_accepted():
    data = make_video(64, 64, frames=8, fps=4)
    assert decode_video(base64.b64encode(data), "video[0]", LIMITS).frames.shape == (4, 64, 64, 3)


@pytest.mark.parametrize("data, fragment", [
    (make_video(frames=20)[:2000], "cannot decode video"),             # truncated: no moov atom
    (make_video(frames=0), "cannot decode video"),                     # a container without frames
    (b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500, "cannot decode video"),  # a header and nothing else
    (b"not a video at all", "nor base64 of one"),
    (b"", "empty video"),
    (make_video(frames=1), "video has too few frames"),  # vLLM's qwen2_vl loader divided by zero (issue 35's harness)
])
def test_hostile_videos_are_invalid_input_naming_the_item(data, fragment):
    with pytest.raises(InvalidInput, match=fragment) as info:
        decode_video(data, "video[1]", LIMITS)
    assert info.value.field == "video[1]"


@pytest.mark.parametrize("limits, fragment", [
    (MediaLimits(max_image_pixels=128 * 96 - 1), "video frames are 128x96, over the 12287-pixel limit"),
    (MediaLimits(max_video_frames=19), "video has 20 frames, over the 19-frame limit"),
    (MediaLimits(max_video_seconds=1.5), "video is 2.0 s long, over the 1.5-second limit"),
    (MediaLimits(max_item_bytes=100), "over the 100-byte limit"),
])
def test_limits_are_checked_on_the_header(limits, fragment):
    with pytest.raises(InvalidInput, match=fragment):
        decode_video(make_video(128, 96, frames=20, fps=10), "video[0]", limits)


def test_video_urls_are_read_as_image_urls_are(tmp_path):
    data = make_video(frames=4)
    assert read_video_url("data:video/mp4;base64," + base64.b64encode(data).decode(), "f", LIMITS) == data
    with pytest.raises(InvalidInput, match="unsupported media type 'image/png'"):
        read_video_url("data:image/png;base64,AAAA", "f", LIMITS)
    (tmp_path / "clip.mp4").write_bytes(data)
    allowed = MediaLimits(allowed_local_media_path=str(tmp_path))
    assert read_video_url(f"file://{tmp_path}/clip.mp4", "f", allowed) == data
    with pytest.raises(InvalidInput, match="file:// URLs are disabled"):
        read_video_url(f"file://{tmp_path}/clip.mp4", "f", LIMITS)


def _messages(*parts) -> str:
    return json.dumps([{"role": "user", "content": [*parts, {"type": "text", "text": "what happens?"}]}])


def test_chat_video_parts_and_the_video_tensor_decode_for_llm():
    url = "data:video/mp4;base64," + base64.b64encode(make_video(seed=1)).decode()
    raw = RawGenerateInputs(messages=_messages({"type": "image"}, {"type": "video_url", "video_url": {"url": url}},
                                               {"type": "video"}),
                            images=(image_bytes(64, 64, 1),), videos=(make_video(seed=2),))
    request = parse_generate_request(raw, DecodeMedia(LIMITS))
    assert [part["type"] for part in request.conversation[0]["content"]] == ["image", "video", "video", "text"]
    kinds = [type(item).__name__ for item in request.items]
    assert kinds == ["Image", "DecodedVideo", "DecodedVideo"]
    data = multi_modal_data(request)
    assert list(data) == ["image", "video"] and len(data["image"]) == 1 and len(data["video"]) == 2
    assert isinstance(data["video"][0], tuple) and data["video"][0][0].shape[-1] == 3


def test_epd_keeps_video_bytes_and_counts_them_against_max_videos():
    video = make_video(frames=4)
    request = parse_generate_request(RawGenerateInputs(messages=_messages({"type": "video"}), videos=(video,)),
                                     EncodedMedia(LIMITS))
    [item] = request.items
    assert item.data == video and item.modality == "video" and item.field == "video[0]"
    with pytest.raises(InvalidInput, match="3 videos, over the per-request limit of 2") as info:
        parse_generate_request(RawGenerateInputs(prompt="x", videos=(video,) * 3), EncodedMedia(LIMITS),
                               RequestLimits(max_videos=2))
    assert info.value.field == "video"


def test_a_text_prompt_gets_one_video_placeholder_per_video():
    request = parse_generate_request(RawGenerateInputs(prompt="describe", videos=(make_video(frames=4),)),
                                     EncodedMedia(LIMITS))
    assert request.prompt == "<|vision_start|><|video_pad|><|vision_end|>describe"
    with pytest.raises(InvalidInput, match=r"prompt has 1 video placeholder\(s\) \(<\|video_pad\|>\) but 2 video"):
        parse_generate_request(RawGenerateInputs(prompt="<|video_pad|>", videos=(b"x", b"y")), EncodedMedia(LIMITS))


def _layout(media) -> LayoutMetadata:
    handle = NixlHandle(agent_name="a", agent_metadata=b"m", descriptors=b"d", lease_id="ab", nbytes=4 * 12 * 8,
                        expires_at=1e12)
    return LayoutMetadata("k", "qwen2_vl:abc", "float32", (12, 8), handle, media)


def test_the_video_block_round_trips_and_is_checked():
    layout = _layout(VideoLayout((3, 4, 4)))
    doc = json.loads(layout.to_json())
    assert doc["modality"] == "video" and doc["video"] == {"grid_thw": [3, 4, 4]}
    assert LayoutMetadata.from_json(layout.to_json(), "video_layouts[0]", "qwen2_vl:abc") == layout
    doc["video"]["grid_thw"] = [0, 4, 4]
    with pytest.raises(InvalidInput) as info:
        LayoutMetadata.from_json(json.dumps(doc), "video_layouts[0]")
    assert info.value.field == "video_layouts[0].video.grid_thw"


def test_consumers_group_grids_and_name_items_per_modality():
    layouts = [_layout(VideoLayout((2, 4, 4))), _layout(ImageLayout((1, 2, 6))), _layout(VideoLayout((3, 4, 4)))]
    assert media_fields(layouts) == ["video_layouts[0]", "image_layouts[0]", "video_layouts[1]"]
    grids = media_grids(layouts)
    assert list(grids) == ["video", "image"]
    assert grids["video"].tolist() == [[2, 4, 4], [3, 4, 4]] and grids["image"].tolist() == [[1, 2, 6]]
    request = GenerateRequest(prompt="p", conversation=None, items=(), sampling={},
                              media_embeds={"video": ("E", grids["video"]), "image": (None, grids["image"])})
    assert multi_modal_data(request) == {"video": {"video_embeds": "E", "video_grid_thw": grids["video"]},
                                         "image": {"image_grid_thw": grids["image"]}}


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder.load(MODEL)


def test_the_encoder_encodes_videos_as_the_reference_tower_and_beside_images(encoder):
    video = decode_video(make_video(160, 120, frames=45, fps=15, seed=3), "video[0]", LIMITS)
    image = make_image(100, 80, 3)
    mixed = encoder.encode([video, image])
    alone = encoder.encode([video])[0]
    assert mixed[0].modality == "video" and mixed[0].image_grid_thw == (3, 6, 8) and mixed[1].modality == "image"
    assert torch.equal(mixed[0].embeddings, alone.embeddings)
    assert torch.equal(mixed[1].embeddings, encoder.encode([image])[0].embeddings)
    reference = VisionEncoder.load(MODEL, impl="transformers").encode([video])[0]
    torch.testing.assert_close(alone.embeddings, reference.embeddings, atol=1e-5, rtol=1e-5)
    assert mixed[0].embeddings.shape == (3 * 6 * 8 // 4, reference.embeddings.shape[1])
    assert EncodedItem(alone.embeddings, alone.image_grid_thw, "video").media() == VideoLayout((3, 6, 8))


def test_the_encoder_s_pixels_are_those_vllm_s_own_processing_makes(encoder):
    """vLLM's Qwen2-VL processing (its data parser drops the loader's metadata) calls the checkpoint's HF processor
    with the frames, rescaling and normalizing left to the device (``mm_device_do_normalize``); the encoder calls the
    video processor, which does both: the same pixels, to float32 rounding (as for images)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    video = decode_video(make_video(96, 160, frames=30, fps=12, seed=4), "video[0]", LIMITS)
    config = ModelConfig(model=str(MODEL), dtype="float32", max_model_len=4096, limit_mm_per_prompt={"video": 2})
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    items = processor.info.get_data_parser().parse_mm_data({"video": [video.engine_item()]})
    theirs = processor._apply_hf_processor_main(items, {})
    own = encoder.video_processor(videos=[video.frames], return_tensors="pt")
    assert torch.equal(theirs["video_grid_thw"], own["video_grid_thw"])
    vp = encoder.video_processor
    mean, std = torch.tensor(vp.image_mean).view(1, 3, 1), torch.tensor(vp.image_std).view(1, 3, 1)
    raw = theirs["pixel_values_videos"].float()
    normalized = ((raw.view(raw.shape[0], 3, -1) * vp.rescale_factor - mean) / std).view(raw.shape)
    torch.testing.assert_close(normalized, own["pixel_values_videos"], atol=1e-6, rtol=0)


def test_the_encoder_service_publishes_video_layouts_and_fails_only_a_bad_video_s_request(encoder):
    from backend.encode.service import EncodeJob, EncoderService
    from tests.unit.test_encoder_cache import RecordingPool

    service = EncoderService(encoder, RecordingPool(), LIMITS, "", cache_bytes=1 << 20)
    video = make_video(frames=20, seed=5)
    results = service.run([EncodeJob(0, video, "kv", modality="video"), EncodeJob(1, b"\x00" * 64, "kb", modality="video"),
                           EncodeJob(2, video, "kv2", own_key="own", modality="video")], 3)
    layout = LayoutMetadata.from_json(results[0][0], "video_layouts[0]")
    assert layout.modality == "video" and layout.media == VideoLayout((2, 6, 10)) and layout.content_key == "kv"
    assert isinstance(results[1], InvalidInput) and results[1].field == "video"
    # the same bytes as an image: not the cached video's embeddings
    again = service.run([EncodeJob(0, video, "ki", own_key="own", modality="image")], 1)
    assert isinstance(again[0], InvalidInput) and again[0].field == "image"


def test_the_orchestrator_sends_each_modality_s_layouts_and_names_the_encoder_s_modality():
    import asyncio

    from orchestrator.core import Identity, Orchestrator
    from tests.fakes import FakeSink, FakeStages

    class Stages(FakeStages):
        modalities: list = []

        async def encode(self, item, key, part=None):
            self.modalities.append(item.modality)
            return await super().encode(item, key, part)

    url = "data:video/mp4;base64," + base64.b64encode(b"VIDEO").decode()
    raw = RawGenerateInputs(messages=_messages({"type": "video_url", "video_url": {"url": url}}, {"type": "image"},
                                               {"type": "video"}), images=(b"IMG",), videos=(b"TENSOR",))
    stages = Stages(encode_delay=0)
    asyncio.run(Orchestrator(stages, Identity("m", "p"), RequestLimits()).run(raw, FakeSink()))
    assert stages.modalities == ["video", "image", "video"]
    [sent] = stages.generated
    assert sent.videos == () and sent.images == ()
    assert sent.video_layouts == ('{"layout": 0}', '{"layout": 2}') and sent.image_layouts == ('{"layout": 1}',)
    assert [p["type"] for p in json.loads(sent.messages)[0]["content"]] == ["video", "image", "video", "text"]


def test_a_checkpoint_s_own_video_processor_config_is_part_of_the_content_key(tmp_path):
    from backend.encode.checkpoint import processing_options

    (tmp_path / "preprocessor_config.json").write_text('{"merge_size": 2}')
    images_only = processing_options(tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text('{"fps": 2.0}')
    assert images_only == '{"merge_size":2}' and processing_options(tmp_path) == '{"merge_size":2,"video":{"fps":2.0}}'
