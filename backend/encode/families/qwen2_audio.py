"""Qwen2-Audio: an audio tower and no vision tower. transformers' ``Qwen2AudioEncoder`` and the
``multi_modal_projector`` linear layer into the language model's width (the modules vLLM's
``Qwen2AudioForConditionalGeneration`` runs; ``backend.encode.audio.AudioEncoder`` builds them); its embeddings are
the language model's hidden size wide."""
from __future__ import annotations

from backend.encode.families.base import AudioTower, Family


def _tower_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    return Qwen2AudioEncoder


FAMILY = Family("qwen2_audio", audio=AudioTower(_tower_class), tiny_recipe="qwen2_audio")
