"""Tiny random-weight checkpoints of the other model families: Qwen2.5-VL and Qwen3-VL, built like the Qwen2-VL one
(``devtools.tiny.model``: the same tokenizer, chat template, seeded weights re-drawn at std 1/sqrt(fan_in),
``BUILD_INFO.json`` fingerprint, nothing downloaded).

What each tiny config keeps of its family, so that serving it exercises what differs from Qwen2-VL:

- ``qwen2_5_vl``: the windowed tower. ``window_size`` 56 px is 2x2 merge units (4x4 patches of 14 px), so an image of
  more than 56x56 px has several windows; blocks 0 and 2 attend within windows, ``fullatt_block_indexes`` [1, 3]
  over the whole image. Video timing: ``tokens_per_second`` 4, so M-RoPE's temporal positions are
  ``t * second_per_grid_ts * 4`` and depend on each video's sampled fps.
- ``qwen3_vl``: DeepStack. ``deepstack_visual_indexes`` [0, 1] of 3 blocks: the tower's output is the merged
  embeddings plus two deepstack mergers' outputs, concatenated: 3 x 128 = 384 wide against the language model's
  hidden size of 128. Patches of 16 px, learned position embeddings (8 x 8 grid, interpolated), interleaved M-RoPE,
  a video processor that samples by fps (the prompt carries each temporal patch's ``<t seconds>``).

CLI: ``python -m devtools.tiny --family qwen2_5_vl --out models/tiny-qwen2.5-vl`` (``FAMILIES``).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from devtools.tiny import model as base, omni

RECIPE_VERSION = 1

TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6)


def _qwen2_5_vl(vocab_size: int) -> dict:
    return {
        "text": dict(TEXT, vocab_size=vocab_size, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [4, 6, 6]}),
        "vision": dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, hidden_act="silu", patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=128,
                       window_size=56, fullatt_block_indexes=[1, 3], tokens_per_second=4),
        "image": dict(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2),
    }


def _qwen3_vl(vocab_size: int) -> dict:
    return {
        "text": dict(TEXT, vocab_size=vocab_size, head_dim=32,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                      "mrope_interleaved": True}),
        "vision": dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, hidden_act="gelu_pytorch_tanh",
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=128,
                       num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        # the real checkpoints' normalisation, one for images and videos (vLLM 0.32 normalises both on the device
        # with the image processor's mean and std; HF's video processor uses its own)
        "image": dict(min_pixels=32 * 32, max_pixels=128 * 128, patch_size=16, merge_size=2, temporal_patch_size=2,
                      image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
        "video": dict(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 64 * 64 * 8}, patch_size=16, merge_size=2,
                      temporal_patch_size=2, fps=2, min_frames=4, max_frames=64),
    }


# family -> (config recipe, transformers config class, model class, processor class)
FAMILIES = {
    "qwen2_5_vl": (_qwen2_5_vl, "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": (_qwen3_vl, "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}
DEFAULT_OUT = {"qwen2_vl": "models/tiny-qwen2-vl", "qwen2_5_vl": "models/tiny-qwen2.5-vl",
               "qwen3_vl": "models/tiny-qwen3-vl", "qwen2_5_omni": "models/tiny-qwen2.5-omni"}


def fingerprint(family: str) -> str:
    recipe = FAMILIES[family][0]
    doc = json.dumps({"base": base.recipe_fingerprint(), "family": family, "v": RECIPE_VERSION, "config": recipe(0),
                      "classes": FAMILIES[family][1:]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _model(out: Path, family: str, tokenizer) -> None:
    import torch
    import transformers

    recipe, config_cls, model_cls, _ = FAMILIES[family]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in base.SPECIAL_TOKENS}
    cfg = recipe(len(tokenizer))
    text = dict(cfg["text"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config = getattr(transformers, config_cls)(
        text_config=text, vision_config=cfg["vision"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    config.bos_token_id, config.eos_token_id, config.dtype = ids["<|endoftext|>"], ids["<|im_end|>"], "float32"
    torch.manual_seed(base.SEED)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    base._reinit(model)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def _processors(out: Path, family: str) -> None:
    from transformers import Qwen2VLImageProcessor

    cfg = FAMILIES[family][0](0)
    Qwen2VLImageProcessor(**cfg["image"]).save_pretrained(out)
    if "video" in cfg:
        from transformers import Qwen3VLVideoProcessor

        Qwen3VLVideoProcessor(**cfg["video"]).save_pretrained(out)
    # the processor class vLLM's HF processor loading finds through this file
    (out / "processor_config.json").write_text(json.dumps({"processor_class": FAMILIES[family][3]}))


def build_family(family: str, out: Path, force: bool = False) -> bool:
    """Build ``family``'s tiny checkpoint at ``out`` (``qwen2_vl``: ``devtools.tiny.model.build``). Returns False when an
    identical one already exists."""
    if family == "qwen2_vl":
        return base.build(out, force)
    if family == "qwen2_5_omni":
        return omni.build(out, force)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of qwen2_vl, qwen2_5_omni, {', '.join(FAMILIES)}")

    def make(tmp: Path) -> dict:
        tokenizer = base._build_tokenizer(tmp)
        _model(tmp, family, tokenizer)
        _processors(tmp, family)
        return {"seed": base.SEED, "family": family}

    return base._build_once(out, fingerprint(family), make, force)
