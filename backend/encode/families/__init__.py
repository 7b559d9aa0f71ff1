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

FAMILIES = (qwen2_vl.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl.FAMILY, qwen2_audio.FAMILY, qwen2_5_omni.FAMILY)

_REGISTRY: dict[str, Family] = {}


class UnknownFamily(ValueError):
    """A checkpoint whose ``model_type`` no registered family has."""


def register(family: Family) -> Family:
    """Add ``family`` under its ``model_type`` (ValueError if one is registered under it already)."""
    if family.model_type in _REGISTRY:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    _REGISTRY[family.model_type] = family
    return family


def unregister(model_type: str) -> None:
    del _REGISTRY[model_type]


def family_for(model_type: str) -> Family:
    """The family registered under ``model_type``; ``UnknownFamily`` naming it and the known ones otherwise."""
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnknownFamily(f"no model family known for model_type {model_type!r}; known: "
                            f"{', '.join(sorted(_REGISTRY))}") from None


def known() -> tuple[str, ...]:
    """The registered families' model types, in registration order."""
    return tuple(_REGISTRY)


for _family in FAMILIES:
    register(_family)

__all__ = ["AudioTower", "FAMILIES", "Family", "UnknownFamily", "VisionTower", "family_for", "known", "register",
           "unregister"]
