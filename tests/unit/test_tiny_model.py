"""``devtools.tiny.model.shaped_config``: a real checkpoint's config keeps its fields but for the layer counts and
the tokenizer's vocabulary and special ids."""
import json
from pathlib import Path

from devtools.tiny.model import QWEN_SPECIAL_IDS, shaped_config

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"


def test_shaped_config_keeps_the_real_fields():
    real = json.loads((DATA / "Qwen2.5-VL-3B-Instruct" / "config.json").read_text())
    ids = {real_id: index for index, real_id in enumerate(QWEN_SPECIAL_IDS)}
    doc = shaped_config(real, 1024, ids, layers=2, vision_layers=3)
    assert doc["num_hidden_layers"] == 2 and doc["vision_config"]["depth"] == 3 and doc["vocab_size"] == 1024
    assert doc["vision_config"]["fullatt_block_indexes"] == [2]  # windowed blocks, then one full
    assert doc["image_token_id"] == ids[151655] and doc["eos_token_id"] == ids[151645]
    kept = {k: v for k, v in real.items() if k not in ("num_hidden_layers", "vocab_size", "vision_config",
                                                      "max_window_layers") and not k.endswith("token_id")}
    assert {k: doc[k] for k in kept} == kept  # rope_scaling, tie_word_embeddings, torch_dtype, hidden sizes...
    assert doc["rope_scaling"] == {"type": "mrope", "mrope_section": [16, 24, 24]} and doc["tie_word_embeddings"]
    vision = {k: v for k, v in real["vision_config"].items() if k not in ("depth", "fullatt_block_indexes")}
    assert {k: doc["vision_config"][k] for k in vision} == vision  # window_size 112, out_hidden_size 2048, ...
    assert real["num_hidden_layers"] == 36  # the input is left as it was
