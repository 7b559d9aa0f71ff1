"""Build a tiny random-weight Qwen2-Audio checkpoint locally and deterministically (the audio modality's test model).

Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) is a Whisper-style audio encoder (two convolutions over a
log-mel spectrogram, transformer layers, a 2x average pool) and a linear projector in front of a Qwen2 language model;
vLLM serves it with precomputed audio embeddings (``audio_embeds`` + ``audio_num_tokens``), and its tokenizer family is
the tiny Qwen2-VL's. Everything is as ``devtools.tiny.model`` builds that one (its byte-level BPE tokenizer, its
seeded re-initialisation, its fingerprinted one-shot build), plus the three audio special tokens, Qwen2-Audio's chat
template and a Whisper feature extractor (16 kHz, 30 s chunks: 3000 mel frames, at most 750 audio tokens an item).

CLI: ``python -m devtools.tiny.audio --out models/tiny-qwen2-audio``; a second run with the same recipe is
a no-op (``BUILD_INFO.json``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from devtools.tiny import model as tiny_model

RECIPE_VERSION = 1
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
SAMPLING_RATE = 16_000
MEL_BINS = 80
CHUNK_SECONDS = 30  # Qwen2-Audio's: the feature extractor pads (and truncates) every item to this

# Qwen2-Audio's chat template (its processor's default), for text and audio parts.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config_dict() -> dict:
    return {
        "audio": dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                      d_model=64, max_source_positions=CHUNK_SECONDS * 50, scale_embedding=False,
                      activation_function="gelu"),
        "text": {key: value for key, value in tiny_model._config_dict(0)["text"].items() if key != "rope_parameters"},
    }


def recipe_fingerprint() -> str:
    doc = json.dumps({"v": RECIPE_VERSION, "base": tiny_model.recipe_fingerprint(), "tokens": AUDIO_TOKENS,
                      "template": CHAT_TEMPLATE, "config": _config_dict(),
                      "features": [SAMPLING_RATE, MEL_BINS, CHUNK_SECONDS]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _build(out: Path) -> dict:
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, \
        WhisperFeatureExtractor

    tokenizer = tiny_model._build_tokenizer(out, CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in [*tiny_model.SPECIAL_TOKENS, *AUDIO_TOKENS]}
    cfg = _config_dict()
    text = dict(cfg["text"], vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    config = Qwen2AudioConfig(audio_config=cfg["audio"], text_config=text, audio_token_index=ids["<|AUDIO|>"],
                              bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                              pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(tiny_model.SEED)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    tiny_model._reinit(model)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    _write_original_names(model, out)
    features = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160,
                                       chunk_length=CHUNK_SECONDS, n_fft=400)
    features.save_pretrained(out)  # preprocessor_config.json: the processing options of the content key
    # the processor vLLM loads for this architecture: feature extractor, tokenizer (with the audio tokens), template
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return {"seed": tiny_model.SEED}


# The published Qwen2-Audio checkpoints' tensor names (what vLLM's loader reads), from this transformers' module names;
# transformers 5.19's save_pretrained writes the language model as language_model.model.model.* (checked), vLLM then
# fails to load it
ORIGINAL_NAMES = (("model.audio_tower.", "audio_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
                  ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def _write_original_names(model, out: Path) -> None:
    from safetensors.torch import save_file

    state = {}
    for name, tensor in model.state_dict().items():
        prefix, original = next((p, o) for p, o in ORIGINAL_NAMES if name.startswith(p))
        state[original + name[len(prefix):]] = tensor.contiguous()
    for path in out.glob("*.safetensors*"):
        path.unlink()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def build(out: Path, force: bool = False) -> bool:
    """Build the checkpoint at ``out``. Returns False when an identical one already exists."""
    return tiny_model._build_once(out, recipe_fingerprint(), _build, force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/tiny-qwen2-audio"))
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    built = build(args.out, force=args.force)
    print(f"{'built' if built else 'up to date'}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
