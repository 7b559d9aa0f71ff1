"""The media work a naive EPD consumer does (metadata-only off), with the checkpoint's real image processor."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import ImageLayout
from backend.request.media import MediaLimits, decode_counter
from backend.request.naive_media import process_original_media
from clients.images import image_bytes

CHECKPOINT = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def processor():
    if not CHECKPOINT.exists():
        pytest.skip("no tiny checkpoint (make setup builds it)")
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(CHECKPOINT)


def layout(grid):
    return SimpleNamespace(media=ImageLayout(grid))


def test_each_item_is_decoded_and_checked_against_its_layout(processor):
    # 112x112 and 56x28 pixels: patches of 14 -> grids (1, 8, 8) and (1, 2, 4)
    media = [image_bytes(112, 112, seed=1), image_bytes(56, 28, seed=2)]
    before = decode_counter.count
    seconds = process_original_media(media, [layout((1, 8, 8)), layout((1, 2, 4))], processor, MediaLimits())
    assert seconds > 0 and decode_counter.count == before + 2
    with pytest.raises(InvalidInput) as info:
        process_original_media(media, [layout((1, 8, 8)), layout((1, 4, 4))], processor, MediaLimits())
    assert info.value.field == "original_media[1]"
    with pytest.raises(InvalidInput):
        process_original_media(media[:1], [layout((1, 8, 8)), layout((1, 2, 4))], processor, MediaLimits())


def test_a_video_item_is_decoded_and_run_through_the_video_processor(processor):
    from backend.encode.encoder import load_video_processor
    from backend.protocol.layout import VideoLayout
    from tests.videos import make_video

    video_processor = load_video_processor(CHECKPOINT)
    limits = MediaLimits(video_processor="Qwen2VLVideoProcessor")
    clip = make_video(160, 120, frames=45, fps=15)  # 6 frames of 112x84 after resizing: grid (3, 6, 8)
    media, layouts = [image_bytes(112, 112, seed=1), clip], [layout((1, 8, 8)), SimpleNamespace(media=VideoLayout((3, 6, 8)))]
    before = decode_counter.count
    assert process_original_media(media, layouts, processor, limits, video_processor) > 0
    assert decode_counter.count == before + 2
    with pytest.raises(InvalidInput, match="video_grid_thw"):
        process_original_media([clip], [SimpleNamespace(media=VideoLayout((2, 6, 8)))], processor, limits, video_processor)
    with pytest.raises(InvalidInput, match="no video processor"):
        process_original_media([clip], [SimpleNamespace(media=VideoLayout((3, 6, 8)))], processor, limits)


def test_a_video_is_sampled_as_the_request_s_media_options_say(processor):
    from backend.encode.encoder import load_video_processor
    from backend.protocol.layout import VideoLayout
    from backend.protocol.media_options import MediaOptions
    from tests.videos import make_video

    video_processor = load_video_processor(CHECKPOINT)
    limits = MediaLimits(video_processor="Qwen2VLVideoProcessor")
    clip = make_video(160, 120, frames=45, fps=15)  # 3 s: 6 frames at the default 2 fps (grid t 3); at 1 fps 4 (t 2)
    slow = [SimpleNamespace(media=VideoLayout((2, 6, 8)))]
    options = MediaOptions.parse({"video": {"fps": 1}})
    assert process_original_media([clip], slow, processor, limits, video_processor, options=options) > 0
    with pytest.raises(InvalidInput, match=r"processes to video video_grid_thw \[3, 6, 8\]"):
        process_original_media([clip], slow, processor, limits, video_processor)
