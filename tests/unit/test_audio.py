"""Audio: the request stage's decoding, resampling and limits (``backend.request.audio``), chat parts and tensors of
the audio modality, the layout's audio block, what consumers and the engine are given, and the audio encoder on the
tiny Qwen2-Audio checkpoint."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.engine.host import multi_modal_data
from backend.protocol.errors import InvalidInput
from backend.protocol.layout import AudioLayout, ImageLayout, LayoutMetadata, NixlHandle
from backend.request.audio import DecodedAudio, decode_audio, sampling_rate_for
from devtools.tiny import audio as tiny_audio_model
from backend.request.generate import DecodeMedia, EncodedMedia, GenerateRequest, MediaBytes, RawGenerateInputs, \
    RequestLimits, parse_generate_request
from backend.request.media import MediaLimits, decode_counter
from backend.transfer.engine_inputs import media_fields, media_grids, placeholder_media_embeds
from tests.audios import hostile_audio, make_audio

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-audio"
VL_MODEL = MODEL.parent / "tiny-qwen2-vl"
LIMITS = MediaLimits(audio_sampling_rate=16_000, max_audio_seconds=120)


def test_the_checkpoint_is_built_once_and_its_feature_extractor_sets_the_rate():
    assert tiny_audio_model.build(MODEL) is False  # setup built it with this recipe: a second build is a no-op
    assert sampling_rate_for(MODEL) == 16_000 and sampling_rate_for(VL_MODEL) == 0


@pytest.mark.parametrize("rate, channels", [(8_000, 1), (16_000, 1), (44_100, 2), (22_050, 2)])
def test_audio_decodes_to_mono_at_the_model_s_rate(rate, channels):
    before = decode_counter.count
    audio = decode_audio(make_audio(1.5, rate, channels, seed=1), "audio[0]", LIMITS)
    assert decode_counter.count == before + 1
    assert audio.sampling_rate == 16_000 and audio.samples.shape == (24_000,) and audio.samples.dtype == np.float32
    assert audio.engine_item() is audio.samples and audio.seconds == 1.5


@pytest.mark.parametrize("fmt, subtype", [("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_compressed_formats_decode(fmt, subtype):
    audio = decode_audio(make_audio(1.0, 22_050, seed=4, file_format=fmt, subtype=subtype), "audio[0]", LIMITS)
    assert audio.sampling_rate == 16_000 and abs(len(audio.samples) - 16_000) < 1_200  # MP3 frames pad a little


def test_stereo_is_the_mean_of_its_channels_and_base64_text_is_taken():
    import io

    import soundfile

    left, right = np.linspace(-0.5, 0.5, 1600, dtype=np.float32), np.full(1600, 0.25, np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([left, right], -1), 16_000, subtype="FLOAT", format="WAV")
    audio = decode_audio(base64.b64encode(buf.getvalue()), "audio[0]", LIMITS)
    np.testing.assert_allclose(audio.samples, (left + right) / 2, atol=1e-7)


@pytest.mark.parametrize("kind", list(hostile_audio()))
def test_hostile_audio_is_invalid_naming_the_item(kind):
    data, fragment = hostile_audio()[kind]
    with pytest.raises(InvalidInput) as info:
        decode_audio(data, "audio[1]", LIMITS)
    assert info.value.field == "audio[1]" and fragment in info.value.problem, info.value.problem


def test_limits_bytes_seconds_and_text_that_is_no_audio():
    clip = make_audio(3.0, 16_000)
    with pytest.raises(InvalidInput, match="over the 2-second limit"):
        decode_audio(clip, "audio[0]", MediaLimits(max_audio_seconds=2))
    with pytest.raises(InvalidInput, match="over the 1000-byte limit"):
        decode_audio(clip, "audio[0]", MediaLimits(max_item_bytes=1000))
    with pytest.raises(InvalidInput, match="not an audio file"):
        decode_audio(b"hello, no audio here", "audio[0]", LIMITS)
    with pytest.raises(InvalidInput, match="empty audio"):
        decode_audio(b"", "audio[0]", LIMITS)


def _chat(*parts) -> str:
    return json.dumps([{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}])


def test_chat_parts_of_audio_tensors_data_and_urls():
    clip = make_audio(0.5, 8_000, seed=2)
    data_part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    url_part = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(clip).decode()}}
    raw = RawGenerateInputs(messages=_chat({"type": "audio"}, data_part, url_part), audios=(clip,))
    request = parse_generate_request(raw, EncodedMedia(LIMITS))
    assert request.conversation[0]["content"][:3] == [{"type": "audio"}] * 3
    assert request.items == (MediaBytes(clip, "audio[0]", "audio"),
                              MediaBytes(clip, "messages[0].content[1].input_audio.data", "audio"),
                              MediaBytes(clip, "messages[0].content[2].audio_url", "audio"))
    decoded = parse_generate_request(raw, DecodeMedia(LIMITS))
    assert all(isinstance(item, DecodedAudio) for item in decoded.items)


def test_known_audio_formats_in_any_case_and_none_are_taken():
    clip = base64.b64encode(make_audio(0.5, 8_000, seed=2)).decode()
    for fmt in ("wav", "WAV", "mp3", "flac", None):
        ref = {"data": clip} if fmt is None else {"data": clip, "format": fmt}
        raw = RawGenerateInputs(messages=_chat({"type": "input_audio", "input_audio": ref}))
        assert len(parse_generate_request(raw, EncodedMedia(LIMITS)).items) == 1


@pytest.mark.parametrize("part, field, fragment", [
    ({"type": "input_audio", "input_audio": {"data": "!!"}}, "messages[0].content[0].input_audio.data", "base64"),
    ({"type": "input_audio", "input_audio": "Zg=="}, "messages[0].content[0].input_audio.data", "expected"),
    ({"type": "input_audio", "input_audio": {"data": "Zg==", "format": 3}}, "messages[0].content[0].input_audio.format",
     "unknown format 3"),
    ({"type": "input_audio", "input_audio": {"data": "Zg==", "format": "xyz"}},
     "messages[0].content[0].input_audio.format", "unknown format 'xyz': expected one of wav, mp3"),
    ({"type": "audio_url", "audio_url": {"url": "data:image/png;base64,Zg=="}}, "messages[0].content[0].audio_url",
     "unsupported media type"),
    ({"type": "audio"}, "messages[0].content[0]", "none is left"),
])
def test_bad_audio_parts_name_the_field(part, field, fragment):
    with pytest.raises(InvalidInput) as info:
        parse_generate_request(RawGenerateInputs(messages=_chat(part)), EncodedMedia(LIMITS))
    assert info.value.field == field and fragment in info.value.problem, info.value.problem


def test_the_audio_limit_is_checked_before_decoding_and_placeholders_fill_a_prompt():
    with pytest.raises(InvalidInput, match="3 audios, over the per-request limit of 2") as info:
        parse_generate_request(RawGenerateInputs(prompt="x", audios=(b"a", b"b", b"c")), EncodedMedia(LIMITS),
                               RequestLimits(max_audios=2))
    assert info.value.field == "audio"
    request = parse_generate_request(RawGenerateInputs(prompt="Hear.", audios=(b"RIFF",)), EncodedMedia(LIMITS))
    assert request.prompt == "<|audio_bos|><|AUDIO|><|audio_eos|>Hear."


def _layout(media, shape=(5, 128)) -> LayoutMetadata:
    handle = NixlHandle(agent_name="a", agent_metadata=b"m", descriptors=b"d", lease_id="ab",
                        nbytes=4 * shape[0] * shape[1], expires_at=1e12)
    return LayoutMetadata("k", "qwen2_audio:abc", "float32", shape, handle, media)


def test_the_audio_block_round_trips_and_is_checked():
    layout = _layout(AudioLayout(5, 20))
    doc = json.loads(layout.to_json())
    assert doc["modality"] == "audio" and doc["audio"] == {"num_tokens": 5, "feature_length": 20}
    assert LayoutMetadata.from_json(layout.to_json(), "audio_layouts[0]", "qwen2_audio:abc") == layout
    for change, field in (({"num_tokens": 0}, "audio_layouts[0].audio"), ({"feature_length": "x"}, "audio_layouts[0].audio"),
                          ({"num_tokens": 6}, "audio_layouts[0].audio.num_tokens")):
        bad = json.loads(layout.to_json())
        bad["audio"].update(change)
        with pytest.raises(InvalidInput) as info:
            LayoutMetadata.from_json(json.dumps(bad), "audio_layouts[0]")
        assert info.value.field == field


def test_consumers_give_vllm_audio_item_by_item_with_token_counts():
    layouts = [_layout(AudioLayout(5, 20)), _layout(ImageLayout((1, 2, 6)), (3, 128)), _layout(AudioLayout(7, 28), (7, 128))]
    assert media_fields(layouts) == ["audio_layouts[0]", "image_layouts[0]", "audio_layouts[1]"]
    grids = media_grids(layouts)
    assert grids["audio"].tolist() == [5, 7] and grids["image"].tolist() == [[1, 2, 6]]
    zeros = placeholder_media_embeds(layouts)
    assert [tuple(t.shape) for t in zeros["audio"]] == [(5, 128), (7, 128)] and zeros["image"].shape == (3, 128)
    embeds = [torch.ones(5, 128), torch.ones(7, 128)]
    request = GenerateRequest(prompt="p", conversation=None, items=(), sampling={},
                              media_embeds={"audio": (embeds, grids["audio"])})
    assert multi_modal_data(request) == {"audio": {"audio_embeds": embeds, "audio_num_tokens": grids["audio"]}}
    request = GenerateRequest(prompt="p", conversation=None, items=(), sampling={},
                              media_embeds={"audio": (None, grids["audio"])})
    assert multi_modal_data(request) == {"audio": {"audio_num_tokens": grids["audio"]}}  # a KV consumer: layout only


@pytest.fixture(scope="module")
def encoder():
    from backend.encode.encoder import load_encoder

    return load_encoder(MODEL)


def test_the_encoder_serves_an_audio_only_checkpoint_item_by_item_as_in_a_batch(encoder):
    from backend.encode.audio import AudioEncoder

    assert isinstance(encoder, AudioEncoder) and encoder.modalities == ("audio",) and encoder.video_processor is None
    assert encoder.width == 128  # measured at load: the projector's output, the language model's width
    assert encoder.load_report.bytes_read < encoder.load_report.checkpoint_bytes / 2  # no language model read
    items = [decode_audio(make_audio(s, r, seed=i), f"audio[{i}]", LIMITS)
             for i, (s, r) in enumerate([(2.0, 16_000), (0.3, 8_000), (40.0, 8_000)])]
    batch = encoder.encode(items)
    assert [(item.media().num_tokens, item.media().feature_length) for item in batch] == [(50, 200), (7, 30), (750, 3000)]
    assert all(item.embeddings.shape[1] == 128 for item in batch)  # the language model's width, measured
    for item, alone in zip(batch, (encoder.encode([i])[0] for i in items)):
        torch.testing.assert_close(item.embeddings, alone.embeddings, rtol=0, atol=1e-5)
    other = encoder.encode([decode_audio(make_audio(2.0, 16_000, seed=9), "audio[0]", LIMITS)])[0]
    assert not torch.allclose(other.embeddings, batch[0].embeddings)


def test_an_encoder_refuses_a_modality_it_does_not_take_and_serves_the_rest(encoder):
    from backend.encode.service import EncodeJob, EncoderService
    from tests.unit.test_encoder_cache import RecordingPool

    service = EncoderService(encoder, RecordingPool(), LIMITS)
    good = make_audio(1.0, 16_000, seed=3)
    results = service.run([EncodeJob(0, b"\x89PNG", "k0", modality="image"), EncodeJob(1, good, "k1", modality="audio")], 2)
    assert isinstance(results[0], InvalidInput) and results[0].field == "image"
    assert "takes audio, not image" in results[0].problem
    assert json.loads(results[1][0])["audio"] == {"num_tokens": 25, "feature_length": 100}


def test_the_audio_topology_serves_the_audio_checkpoint_with_its_limits(tmp_path):
    from backend.deploy.render import render_files
    from backend.deploy.topology import load

    topology = load(MODEL.parents[1] / "topologies" / "cpu-audio.yaml", "cpu")
    assert topology.checkpoint.resolve() == MODEL and set(topology.models()) == {
        "llm", "encoder", "pd", "epd", "prefill", "decode", "epd_disagg"}
    files = render_files(topology, tmp_path)
    assert json.loads(files["llm/model.json"])["limit_mm_per_prompt"]["audio"] == 3
    assert 'key: "max_audios" value: { string_value: "3" }' in files["epd/config.pbtxt"]
    assert 'key: "max_audio_seconds" value: { string_value: "120" }' in files["encoder/config.pbtxt"]


def test_the_chat_cli_sends_audio_files_as_audio_parts(tmp_path):
    from clients.chat import build_parser, make_inputs

    (tmp_path / "a.wav").write_bytes(make_audio(0.5))
    inputs = make_inputs(build_parser().parse_args(["--audio", str(tmp_path / "a.wav"), "What is it?"]))
    assert inputs.messages[0]["content"] == [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
    assert inputs.audios == [make_audio(0.5)] and not inputs.images
