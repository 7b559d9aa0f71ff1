"""The model families beside Qwen2-VL: the tiny checkpoints' recipes (``devtools.tiny.families``), the encoder's
per-family rules (``backend.encode.families``) against what vLLM and transformers compute, the layout's video timing
(schema 7) and embedding width, and the consumer's fields for vLLM (``media_kwargs``)."""
from __future__ import annotations

import json

import pytest
import torch

from backend.deploy.local_server import ROOT
from backend.encode.families import family_for
from backend.encode.families.qwen3_vl import frame_timestamps
from backend.encode.checkpoint import embedding_width
from backend.engine.host import multi_modal_data
from backend.protocol.errors import InvalidInput
from backend.protocol.layout import ImageLayout, LayoutMetadata, NixlHandle, VideoLayout
from backend.request.generate import GenerateRequest, LayoutMedia
from backend.request.media import MediaLimits
from backend.request.video import decode_video, video_processor_for
from backend.transfer.engine_inputs import media_grids, media_kwargs
from devtools.tiny.families import DEFAULT_OUT, FAMILIES, build_family, fingerprint
from tests.videos import make_video


@pytest.fixture(scope="module")
def checkpoints():
    """The tiny checkpoints (built here if setup has not: idempotent, a no-op when up to date)."""
    for family in FAMILIES:
        build_family(family, ROOT / DEFAULT_OUT[family])
    return {family: ROOT / DEFAULT_OUT[family] for family in ("qwen2_vl", *FAMILIES)}


def test_fingerprints_are_per_family_and_stable():
    assert fingerprint("qwen2_5_vl") == fingerprint("qwen2_5_vl") != fingerprint("qwen3_vl")


def test_a_second_build_is_a_no_op(checkpoints):
    assert build_family("qwen3_vl", checkpoints["qwen3_vl"]) is False
    info = json.loads((checkpoints["qwen3_vl"] / "BUILD_INFO.json").read_text())
    assert info["fingerprint"] == fingerprint("qwen3_vl") and info["family"] == "qwen3_vl"


def test_qwen2_5_vl_s_window_attention_matters_in_the_tiny_config(checkpoints):
    """The largest image the tiny processor makes has several windows, and the windowed blocks change its embeddings:
    the same tower with every block attending over the whole image gives other embeddings (so a consumer that got
    window attention wrong would not match llm)."""
    import copy

    from backend.encode.encoder import VisionEncoder
    from backend.encode.packed_tower import PackedTower
    from tests.images import make_image

    encoder = VisionEncoder.load(checkpoints["qwen2_5_vl"])
    cfg = json.loads((checkpoints["qwen2_5_vl"] / "config.json").read_text())["vision_config"]
    batch = encoder.processor(images=[make_image(400, 400, 3)], return_tensors="pt")
    (t, h, w), = batch["image_grid_thw"].tolist()
    units = lambda n: -(-n // cfg["spatial_merge_size"] // (cfg["window_size"] // cfg["spatial_merge_size"]
                                                             // cfg["patch_size"]))
    assert units(h) * units(w) > 1, (h, w)  # patches per side over merge units per window, rounded up
    assert encoder.forward.full_blocks and encoder.forward.full_blocks < set(range(cfg["depth"]))
    all_full = copy.deepcopy(encoder.tower.config)
    all_full.fullatt_block_indexes = list(range(cfg["depth"]))
    with torch.inference_mode():
        windowed = encoder.forward(batch["pixel_values"], batch["image_grid_thw"])
        full = PackedTower(encoder.tower, all_full)(batch["pixel_values"], batch["image_grid_thw"])
    assert windowed.shape == full.shape and (windowed - full).abs().max() > 1e-3 * windowed.abs().max()


def test_embedding_widths_come_from_the_config(checkpoints):
    assert {family: embedding_width(path) for family, path in checkpoints.items()} == {
        "qwen2_vl": 128, "qwen2_5_vl": 128, "qwen3_vl": 128 * 3}
    like = ROOT / "tests" / "data" / "checkpoints"
    assert embedding_width(like / "Qwen2-VL-2B-Instruct") == 1536 and embedding_width(like / "Qwen2.5-VL-3B-Instruct") == 2048
    assert embedding_width(like / "Qwen2.5-VL-7B-Instruct") == 3584  # the GPU machine's 7B shape (its merger's width)


def _video(checkpoint, *clip):
    return decode_video(make_video(*clip[:2], frames=clip[2], fps=clip[3], seed=5), "video",
                        MediaLimits(video_processor=video_processor_for(checkpoint)))


@pytest.mark.parametrize("clip", [(160, 120, 45, 15), (96, 160, 30, 12), (64, 64, 8, 1)])
def test_second_per_grid_ts_is_the_hf_processor_s(checkpoints, clip):
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    video = _video(checkpoints["qwen2_5_vl"], *clip)
    processor = AutoProcessor.from_pretrained(checkpoints["qwen2_5_vl"])
    metadata = VideoMetadata(**{k: v for k, v in video.metadata.items() if k != "do_sample_frames"})
    want = processor(text="<|video_pad|>", videos=[video.frames], video_metadata=[metadata])["second_per_grid_ts"]
    got = family_for("qwen2_5_vl").video_timing(video, processor.video_processor.temporal_patch_size)
    assert got == {"second_per_grid_ts": want[0]}


@pytest.mark.parametrize("indices, fps", [([0, 9, 18, 26, 35, 44], 15.0), ([0, 1, 2, 3, 4], 1.0), ([3], 24.0)])
def test_qwen3_vl_timestamps_are_vllm_s(indices, fps):
    from vllm.model_executor.models.qwen3_vl import Qwen3VLProcessingInfo

    assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessingInfo._calculate_timestamps(None, indices, fps, 2)


def test_the_qwen3_vl_encoder_s_video_layout_carries_its_timestamps(checkpoints):
    from backend.encode.encoder import VisionEncoder

    encoder = VisionEncoder.load(checkpoints["qwen3_vl"])  # the transformers tower: the packed one has no DeepStack
    assert encoder.width == 384 and not hasattr(encoder.forward, "tower")
    video = _video(checkpoints["qwen3_vl"], 160, 120, 45, 15)
    item = encoder.encode([video])[0]
    assert item.image_grid_thw[0] == 3 and item.media().timestamps == pytest.approx((0.3, 22 / 15, 79 / 30))


def _layout(media, shape=(12, 8)) -> LayoutMetadata:
    handle = NixlHandle(agent_name="a", agent_metadata=b"m", descriptors=b"d", lease_id="ab",
                        nbytes=4 * shape[0] * shape[1], expires_at=1e12)
    return LayoutMetadata("k", "m:1", "float32", shape, handle, media)


def test_the_video_timing_round_trips_and_is_checked():
    for media in (VideoLayout((3, 2, 2), second_per_grid_ts=1.25), VideoLayout((3, 2, 2), timestamps=(0.5, 1.5, 2.5)),
                  VideoLayout((1, 2, 2), (2, 3), second_per_grid_ts=2.0)):
        layout = _layout(media)
        assert LayoutMetadata.from_json(layout.to_json(), "video_layouts[0]") == layout
    doc = json.loads(_layout(VideoLayout((3, 2, 2))).to_json())
    assert doc["video"] == {"grid_thw": [3, 2, 2]}  # a family without timing leaves it out
    for member, value in (("second_per_grid_ts", 0), ("second_per_grid_ts", "1"), ("timestamps", [0.5, 1.5]),
                          ("timestamps", 0.5), ("timestamps", [0.5, None, 1.0])):
        bad = {**doc, "video": {**doc["video"], member: value}}
        with pytest.raises(InvalidInput) as info:
            LayoutMetadata.from_json(json.dumps(bad), "video_layouts[0]")
        assert info.value.field == f"video_layouts[0].video.{member}", (member, value)


def test_a_consumer_refuses_embeddings_of_another_width_naming_the_field():
    text = _layout(ImageLayout((1, 4, 12)), shape=(12, 128)).to_json()
    assert LayoutMedia("m:1", 128).from_layout(text, "image_layouts[0]", None).shape == (12, 128)
    with pytest.raises(InvalidInput) as info:
        LayoutMedia("m:1", 384).from_layout(text, "image_layouts[0]", None)
    assert info.value.field == "image_layouts[0].shape"
    assert "embeddings are 128 wide, this consumer's model takes 384-wide image embeddings" in str(info.value)


def test_media_kwargs_give_vllm_the_timing_per_item_parts_joined():
    layouts = [_layout(VideoLayout((2, 2, 2), (0, 3), timestamps=(0.5, 1.5)), shape=(2, 8)),
               _layout(VideoLayout((1, 2, 2), (2, 3), timestamps=(2.5,)), shape=(1, 8)),
               _layout(ImageLayout((1, 2, 2)), shape=(1, 8)), _layout(VideoLayout((1, 2, 2), timestamps=(0.25,)))]
    assert media_grids(layouts)["video"].tolist() == [[3, 2, 2], [1, 2, 2]]
    assert media_kwargs(layouts) == {"video": {"timestamps": [[0.5, 1.5, 2.5], [0.25]]}}
    seconds = media_kwargs([_layout(VideoLayout((1, 2, 2), second_per_grid_ts=x)) for x in (1.25, 2 / 1.7)])
    assert seconds["video"]["second_per_grid_ts"].dtype == torch.float32  # as the HF processor's tensor
    assert seconds["video"]["second_per_grid_ts"].tolist() == torch.tensor([1.25, 2 / 1.7]).tolist()
    assert media_kwargs([_layout(VideoLayout((1, 2, 2)))]) == {}
    with pytest.raises(InvalidInput) as info:
        media_kwargs([_layout(VideoLayout((1, 2, 2), second_per_grid_ts=1.0)), _layout(VideoLayout((1, 2, 2)))])
    assert info.value.field == "video_layouts[1].video.second_per_grid_ts"


def test_the_engine_gets_the_timing_beside_the_embeddings_and_the_grid():
    grid = torch.tensor([[2, 2, 2]])
    request = GenerateRequest(prompt="p", conversation=None, items=(), sampling={},
                              media_embeds={"video": ("E", grid)}, media_kwargs={"video": {"timestamps": [[0.5, 1.5]]}})
    assert multi_modal_data(request) == {"video": {"video_embeds": "E", "video_grid_thw": grid,
                                                   "timestamps": [[0.5, 1.5]]}}
    layout_only = GenerateRequest(prompt="p", conversation=None, items=(), sampling={},
                                  media_embeds={"video": (None, grid)}, media_kwargs={"video": {"timestamps": [[0.5]]}})
    assert multi_modal_data(layout_only) == {"video": {"video_grid_thw": grid, "timestamps": [[0.5]]}}
