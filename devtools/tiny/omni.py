"""Build a tiny random-weight Qwen2.5-Omni checkpoint (the thinker only) locally and deterministically: the omni
family's test model, with a vision tower (images and videos) and an audio tower in one checkpoint.

vLLM 0.32 serves ``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration`` with its
``Qwen2_5OmniThinkerForConditionalGeneration`` (the talker and token2wav tensors are skipped: ``talker.`` and
``token2wav.`` map to nothing), reading ``config.json``'s ``thinker_config``. So the builder writes a
``Qwen2_5OmniConfig`` whose thinker is tiny (``enable_audio_output`` false) and the thinker's tensors under
``thinker.``, as the published checkpoints name them. Everything else is as ``devtools.tiny.model`` builds the tiny
Qwen2-VL: its byte-level BPE tokenizer plus Qwen2.5-Omni's media tokens, its seeded re-initialisation (std
1/sqrt(fan_in): the answers depend on the media), its fingerprinted one-shot build.

Tiny config: the language model of the other tiny families (2 layers, hidden 128, M-RoPE ``mrope_section`` [4, 6, 6]);
Qwen2.5-VL's tiny windowed vision tower (4 blocks of 64, windows of 2x2 merge units, ``fullatt_block_indexes``
[1, 3]) projected to 128; a Whisper-style audio tower (2 layers of 64, 80 mel bins, chunks of ``n_window`` x 2 frames)
projected to 128 (``output_dim``). Both towers output the language model's width, as in the real model.

CLI: ``python -m devtools.tiny --family qwen2_5_omni`` (``models/tiny-qwen2.5-omni``).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from devtools.tiny import model as base

RECIPE_VERSION = 1
MEDIA_TOKENS = ["<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
# the tokenizer attributes Qwen2_5OmniProcessor reads (the vision ones are the base tokenizer's own tokens)
NAMED_TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
SAMPLING_RATE = 16_000
MEL_BINS = 80

# Qwen2.5-Omni's chat template, reduced to text, image, video and audio parts
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|IMAGE|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|VIDEO|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config_dict() -> dict:
    text = {key: value for key, value in base._config_dict(0)["text"].items() if key != "vocab_size"}
    return {
        "text": text,
        "vision": dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, hidden_act="silu", patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=128,
                       window_size=56, fullatt_block_indexes=[1, 3], tokens_per_second=4),
        "audio": dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                      d_model=64, max_source_positions=1500, n_window=100, output_dim=128),
        "image": dict(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2),
        "video": dict(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2),
    }


def recipe_fingerprint() -> str:
    doc = json.dumps({"v": RECIPE_VERSION, "base": base.recipe_fingerprint(), "tokens": MEDIA_TOKENS,
                      "named": NAMED_TOKENS, "template": CHAT_TEMPLATE, "config": _config_dict(),
                      "features": [SAMPLING_RATE, MEL_BINS]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _tokenizer(out: Path):
    """The base tokenizer plus the media tokens, named as ``Qwen2_5OmniProcessor`` reads them (``image_token``, ...:
    the tokenizer config's ``extra_special_tokens`` as a mapping)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = base._build_tokenizer(out, CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": MEDIA_TOKENS})
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "extra_special_tokens": NAMED_TOKENS}, indent=2))
    return PreTrainedTokenizerFast.from_pretrained(out)


def _thinker_config(ids: dict, vocab_size: int):
    from transformers import Qwen2_5OmniThinkerConfig

    cfg = _config_dict()
    text = dict(cfg["text"], vocab_size=vocab_size, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    return Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=cfg["vision"], audio_config=cfg["audio"],
        image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"], audio_token_index=ids["<|AUDIO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        position_id_per_seconds=25, seconds_per_chunk=2, tie_word_embeddings=False)


def _model(out: Path, tokenizer) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in [*base.SPECIAL_TOKENS, *MEDIA_TOKENS]}
    thinker = _thinker_config(ids, len(tokenizer))
    thinker.dtype = "float32"
    torch.manual_seed(base.SEED)
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker).to(torch.float32)
    base._reinit(model)
    save_file({"thinker." + name: t.contiguous() for name, t in model.state_dict().items()},
              out / "model.safetensors", metadata={"format": "pt"})
    config = Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
    config.architectures, config.dtype = ["Qwen2_5OmniModel"], "float32"
    config.save_pretrained(out)
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(out)


def _processor(out: Path, tokenizer) -> None:
    from transformers import (Qwen2_5OmniProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor,
                              WhisperFeatureExtractor)

    cfg = _config_dict()
    features = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160,
                                       chunk_length=30, n_fft=400)
    Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(**cfg["image"]),
                         video_processor=Qwen2VLVideoProcessor(**cfg["video"]), feature_extractor=features,
                         tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(out)


def _build(out: Path) -> dict:
    tokenizer = _tokenizer(out)
    _model(out, tokenizer)
    _processor(out, tokenizer)
    return {"seed": base.SEED, "family": "qwen2_5_omni"}


def build(out: Path, force: bool = False) -> bool:
    """Build the checkpoint at ``out``. Returns False when an identical one already exists."""
    return base._build_once(out, recipe_fingerprint(), _build, force)
