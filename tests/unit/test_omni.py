"""The omni family (Qwen2.5-Omni's thinker, ``backend.encode.families.qwen2_5_omni``): its registry entry, widths per
modality read from ``thinker_config``, placeholders, the tiny recipe (``devtools.tiny.omni``), the encoder over both
towers (``backend.encode.towers.TowersEncoder``) and the vLLM patch's feature lengths (``backend.engine.omni_audio``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from backend.deploy.local_server import ROOT
from backend.encode.checkpoint import embedding_width, embedding_widths
from backend.encode.families import family_for
from backend.engine.omni_audio import feature_lengths
from backend.protocol.errors import InvalidInput
from backend.request.audio import DecodedAudio
from devtools.tiny.families import DEFAULT_OUT, build_family

THINKER = {"vision_config": {"out_hidden_size": 96, "hidden_size": 64},
           "audio_config": {"output_dim": 80, "d_model": 32}, "text_config": {"hidden_size": 128}}


@pytest.fixture(scope="module")
def checkpoint():
    path = ROOT / DEFAULT_OUT["qwen2_5_omni"]
    build_family("qwen2_5_omni", path)
    return path


@pytest.fixture(scope="module")
def encoder(checkpoint):
    from backend.encode.encoder import load_encoder

    return load_encoder(checkpoint)


def test_the_family_has_both_towers_its_placeholders_and_the_thinker_s_config():
    family = family_for("qwen2_5_omni")
    assert family.modalities == ("image", "video", "audio") and family.tiny_recipe == "qwen2_5_omni"
    assert family.vision.prefixes == ("thinker.visual.",) and family.audio.prefixes == ("thinker.audio_tower.",)
    assert family.audio.packed_features and family.audio.projector_prefixes == ()
    assert family.placeholders["audio"] == ("<|AUDIO|>", "<|audio_bos|><|AUDIO|><|audio_eos|>")
    assert family.placeholders["image"][0] == "<|IMAGE|>" and family.placeholders["video"][0] == "<|VIDEO|>"


def test_widths_are_per_modality_from_the_thinker_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni", "thinker_config": THINKER}))
    assert embedding_widths(tmp_path) == {"image": 96, "video": 96, "audio": 80}
    with pytest.raises(ValueError, match="differ in width per modality"):
        embedding_width(tmp_path)


def test_the_tiny_checkpoint_is_a_thinker_only_omni_model(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniModel"] and config["enable_audio_output"] is False
    assert embedding_widths(checkpoint) == {"image": 128, "video": 128, "audio": 128}
    assert build_family("qwen2_5_omni", checkpoint) is False  # fingerprinted: a second build is a no-op


def test_the_towers_encoder_routes_each_item_to_its_tower_in_order(encoder):
    assert type(encoder).__name__ == "TowersEncoder" and encoder.modalities == ("image", "video", "audio")
    rng = np.random.default_rng(0)
    sound = DecodedAudio((rng.standard_normal(32_000) * 0.1).astype(np.float32), 16_000)
    image = Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8))
    mixed = encoder.encode([sound, image, sound])
    assert [item.modality for item in mixed] == ["audio", "image", "audio"]
    assert mixed[0].media().num_tokens == 50 and tuple(mixed[0].embeddings.shape) == (50, 128)
    alone = encoder.encode([image])[0]
    assert torch.equal(alone.embeddings, mixed[1].embeddings)  # a batch's mix does not change an item
    assert torch.allclose(encoder.encode([sound])[0].embeddings, mixed[2].embeddings, atol=1e-5)


def test_the_patch_s_feature_lengths_give_the_token_counts():
    tokens = torch.tensor([1, 2, 25, 50, 750])
    lengths = feature_lengths(tokens)
    assert torch.equal(((lengths - 1) // 2 + 1 - 2) // 2 + 1, tokens)


def test_a_towers_encoder_refuses_a_modality_none_of_its_towers_takes(encoder):
    from backend.encode.towers import TowersEncoder

    only_audio = TowersEncoder([encoder.encoders[1]])
    with pytest.raises(InvalidInput, match="takes audio, not image"):
        only_audio.encode([Image.new("RGB", (32, 32))])


def test_the_video_size_and_timing_are_the_omni_processor_s(checkpoint, encoder):
    """vLLM calls Qwen2_5OmniProcessor, whose own defaults size the frames and give second_per_grid_ts (2 / 2.0)."""
    from transformers import AutoProcessor

    from backend.request.video import DecodedVideo

    frames = np.random.default_rng(1).integers(0, 255, (4, 120, 160, 3), dtype=np.uint8)
    hf = AutoProcessor.from_pretrained(checkpoint)(text="<|vision_start|><|VIDEO|><|vision_end|>", videos=[frames],
                                                   return_tensors="pt")
    metadata = {"total_num_frames": 4, "fps": 4.0, "duration": 1.0, "frames_indices": [0, 1, 2, 3],
                "do_sample_frames": False}
    item = encoder.encode([DecodedVideo(frames, metadata)])[0]
    assert list(item.image_grid_thw) == hf["video_grid_thw"][0].tolist()
    assert dict(item.timing) == {"second_per_grid_ts": float(hf["video_second_per_grid"][0])}
