"""The model families the encoder knows, by their checkpoint's ``model_type``: one module each (its towers, video
processor rules, timing, embedding widths, placeholders, tiny-checkpoint recipe; ``base.Family``), registered here.

Who asks: ``backend.encode.encoder`` (``family_for(config.model_type)`` at load: which encoder, which tower class,
packed or not, the family's video rules per batch) and ``backend.encode.checkpoint`` (the embedding widths). Code
that uses a family asks it, and never branches on the name. A new family: its module here and its line in
``FAMILIES``.
"""
from __future__ import annotations

from backend.encode.families import qwen2_5_omni, qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_vl
from backend.encode.families.base import AudioTower, Family, VisionTower
from backend.protocol.registry import Registry

FAMILIES = (qwen2_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl.FAMILY, qwen2_audio.FAMILY, qwen2_5_omni.FAMILY)


class UnknownFamily(ValueError):
    """A checkpoint whose ``model_type`` no registered family has."""


_REGISTRY: Registry[Family] = Registry("model family known for model_type", lambda family: family.model_type,
                                      UnknownFamily, sort=True)
register, unregister = _REGISTRY.register, _REGISTRY.unregister
family_for = _REGISTRY.get  # the family registered under a model_type; UnknownFamily naming the known ones otherwise
known = _REGISTRY.names  # the registered families' model types, in registration order


for _family in FAMILIES:
    register(_family)

__all__ = ["AudioTower", "FAMILIES", "Family", "UnknownFamily", "VisionTower", "family_for", "known", "register",
           "unregister"]
