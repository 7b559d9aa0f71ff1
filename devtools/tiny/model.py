"""Build a tiny random-weight Qwen2-VL (or --family: Qwen2.5-VL, Qwen3-VL) checkpoint locally and deterministically.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a fixed built-in
corpus, the config is written here, and the weights are drawn from a seeded generator.
HF's default init (std 0.02) gives a model whose output ignores the image, which would
make every equality test vacuous; so matrices are re-drawn with std 1/sqrt(fan_in) and
token embeddings with std 1, which makes different images give different tokens.

CLI (``devtools.tiny.__main__``): ``python -m devtools.tiny --out models/tiny-qwen2-vl``. The output directory
holds a ``BUILD_INFO.json`` fingerprint; a second run with the same recipe is a no-op. ``--family qwen2_5_vl`` /
``qwen3_vl`` builds the other families' tiny checkpoints (``devtools.tiny.families``).

``--like DIR`` (``build_like``) builds instead a checkpoint shaped like a real one from its published files
(config, image processor, generation config, chat template: tests/data/checkpoints), with fewer layers.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
SEED = 1234
IMAGE_MIN_PIXELS = 28 * 28
IMAGE_MAX_PIXELS = 112 * 112
VOCAB_SIZE = 1024

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# Qwen2-VL's chat template, reduced to what the tiny model needs: text and image/video parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS_WORDS = (
    "the a an is are was what which who where when how why describe image picture photo "
    "color red green blue yellow black white left right top bottom cat dog car tree sky "
    "house person people one two three four many small large bright dark shape circle "
    "square line pattern there this that it of in on at with and or not answer question "
    "please tell me about you assistant user system helpful shows contains see look"
).split()


def _corpus() -> list[str]:
    """A fixed pseudo-random corpus (no RNG state shared with anything else)."""
    lines = []
    n = len(_CORPUS_WORDS)
    for i in range(4000):
        words = [_CORPUS_WORDS[(i * 7 + j * j * 13 + j) % n] for j in range(3 + i % 11)]
        lines.append(" ".join(words) + (" ?" if i % 3 == 0 else " ."))
    lines.append(CHAT_TEMPLATE)
    return lines


def recipe_fingerprint() -> str:
    doc = json.dumps({
        "v": RECIPE_VERSION, "seed": SEED, "vocab": VOCAB_SIZE, "special": SPECIAL_TOKENS,
        "template": CHAT_TEMPLATE, "pixels": [IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS],
        "config": _config_dict(0), "corpus": hashlib.sha256("\n".join(_corpus()).encode()).hexdigest(),
    }, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _build_tokenizer(out: Path, chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, model_max_length=4096, chat_template=chat_template,
    )
    fast.save_pretrained(out)
    return fast


def _config_dict(vocab_size: int) -> dict:
    return {
        "text": dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "mrope_section": [4, 6, 6]}),
        "vision": dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
    }


def _reinit(model, seed: int = SEED) -> None:
    """Matrices std 1/sqrt(fan_in), token embeddings std 1, biases 0 (see the module docstring). Tied embeddings
    (the output layer is the embedding matrix) get std 1/sqrt(hidden) instead: at std 1 each token's own
    embedding dominates its logits and the model repeats its last prompt token whatever the image."""
    import torch

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                embedding = "embed_tokens" in name
                std = (1.0 / math.sqrt(param.shape[1]) if tied else 1.0) if embedding else 1.0 / math.sqrt(param[0].numel())
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif name.endswith("bias"):
                param.zero_()


def _build_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    cfg = _config_dict(len(tokenizer))
    text = dict(cfg["text"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config = Qwen2VLConfig(
        text_config=text, vision_config=cfg["vision"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    _reinit(model)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def _build_processor(out: Path) -> None:
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS,
                                 patch_size=14, merge_size=2, temporal_patch_size=2)
    proc.save_pretrained(out)
    # Qwen2VLProcessor (what vLLM loads for this architecture) is found through this file.
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))


def _build_once(out: Path, fingerprint: str, make, force: bool = False) -> bool:
    """``make(tmp) -> info`` builds a checkpoint into a temporary folder beside ``out``, which then replaces
    ``out`` with ``BUILD_INFO.json`` (``info`` and the fingerprint). False: ``out`` has this fingerprint already."""
    out = Path(out)
    info = out / "BUILD_INFO.json"
    if not force and info.exists() and json.loads(info.read_text()).get("fingerprint") == fingerprint:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-model-", dir=out.parent))
    try:
        details = make(tmp)
        (tmp / "BUILD_INFO.json").write_text(json.dumps({"fingerprint": fingerprint, **details}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def build(out: Path, force: bool = False) -> bool:
    """Build the checkpoint at ``out``. Returns False when an identical one already exists."""
    def make(tmp: Path) -> dict:
        tokenizer = _build_tokenizer(tmp)
        _build_model(tmp, tokenizer)
        _build_processor(tmp)
        return {"seed": SEED}

    return _build_once(out, recipe_fingerprint(), make, force)


# -- a checkpoint shaped like a real one ------------------------------------------------------------
# The special tokens' ids in Qwen2-VL / Qwen2.5-VL checkpoints (their config and generation config name them).
QWEN_SPECIAL_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151652: "<|vision_start|>",
                    151653: "<|vision_end|>", 151654: "<|vision_pad|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>"}
LIKE_RECIPE = 2  # bump when build_like makes other weights or files
LIKE_FILES = ("config.json", "preprocessor_config.json", "generation_config.json", "chat_template.json")


def _remap_ids(doc, ids: dict[int, int]):
    """``doc`` with every ``*_token_id`` field (an int or a list, at any depth) mapped through ``ids``."""
    if not isinstance(doc, dict):
        return doc
    out = {}
    for key, value in doc.items():
        if key.endswith("token_id"):
            value = [ids.get(v, v) for v in value] if isinstance(value, list) else ids.get(value, value)
        out[key] = _remap_ids(value, ids)
    return out


def shaped_config(real: dict, vocab_size: int, ids: dict[int, int], layers: int, vision_layers: int) -> dict:
    """A real checkpoint's config.json, kept as it is (field names, rope scaling, window sizes, tied embeddings,
    dtype) but for: ``layers`` language-model layers, ``vision_layers`` tower blocks (Qwen2.5-VL: windowed
    attention in all but the last, which attends fully), and the tokenizer's vocabulary size and special ids."""
    doc = _remap_ids(json.loads(json.dumps(real)), ids)
    doc.update(num_hidden_layers=layers, vocab_size=vocab_size)
    if "max_window_layers" in doc:
        doc["max_window_layers"] = min(doc["max_window_layers"], layers)
    vision = doc["vision_config"]
    vision["depth"] = vision_layers
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [vision_layers - 1]
    return doc


def build_like(source: Path, out: Path, layers: int = 2, vision_layers: int = 2, force: bool = False) -> bool:
    """Build at ``out`` a random-weight checkpoint shaped like the real one whose files are in ``source``
    (``LIKE_FILES``: its config, image processor, generation config and chat template; ``shaped_config`` says
    what changes), with this module's tokenizer. Returns False when an identical one already exists."""
    import torch
    import transformers

    source = Path(source)
    texts = {name: (source / name).read_text() for name in LIKE_FILES if (source / name).exists()}
    fingerprint = hashlib.sha256(json.dumps({"recipe": recipe_fingerprint(), "like": LIKE_RECIPE, "files": texts,
                                             "layers": layers, "vision_layers": vision_layers},
                                            sort_keys=True).encode()).hexdigest()[:16]

    def make(tmp: Path) -> dict:
        template = json.loads(texts["chat_template.json"])["chat_template"] if "chat_template.json" in texts else CHAT_TEMPLATE
        tokenizer = _build_tokenizer(tmp, template)
        ids = {real: tokenizer.convert_tokens_to_ids(token) for real, token in QWEN_SPECIAL_IDS.items()}
        config_doc = shaped_config(json.loads(texts["config.json"]), len(tokenizer), ids, layers, vision_layers)
        (tmp / "config.json").write_text(json.dumps(config_doc, indent=2))
        config = transformers.AutoConfig.from_pretrained(tmp)  # the real file's format, read as loaders read it
        torch.manual_seed(SEED)
        model = getattr(transformers, config_doc["architectures"][0])(config).to(torch.float32)
        _reinit(model)
        model.save_pretrained(tmp, safe_serialization=True)
        # save_pretrained rewrote them in this transformers' format: the real files' format, as a user has it
        (tmp / "config.json").write_text(json.dumps(config_doc, indent=2))
        for name in ("preprocessor_config.json", "generation_config.json", "chat_template.json"):
            if name in texts:
                (tmp / name).write_text(json.dumps(_remap_ids(json.loads(texts[name]), ids), indent=2))
        processor = json.loads(texts["preprocessor_config.json"]).get("processor_class", "Qwen2VLProcessor")
        (tmp / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
        return {"like": str(source), "layers": layers, "vision_layers": vision_layers}

    return _build_once(out, fingerprint, make, force)
