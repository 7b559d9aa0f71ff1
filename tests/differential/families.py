"""What the differential harness knows of each family's topology: the file, the modalities its checkpoint takes, the
per-request item limits (the topology's ``limits``, with the interface's defaults where it gives none) and the
prompt placeholders (every family here uses the Qwen2-VL tokens, ``backend.protocol.modality``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.protocol.modality import modality


@dataclass(frozen=True)
class Family:
    name: str
    topology: str                      # under topologies/
    modalities: tuple[str, ...]        # what its checkpoint takes
    limits: dict[str, int] = field(default_factory=dict)  # modality -> items per request

    def placeholder(self, name: str) -> str:
        """One item of modality ``name`` in a ``text_input`` prompt."""
        return modality(name).placeholder


VISION_LIMITS = {"image": 4, "video": 2}  # limits.max_images of the topologies; max_videos: the default, 2
FAMILIES = {
    "qwen2_vl": Family("qwen2_vl", "default.yaml", ("image", "video"), VISION_LIMITS),
    "qwen2_5_vl": Family("qwen2_5_vl", "cpu-qwen2.5-vl.yaml", ("image", "video"), VISION_LIMITS),
    "qwen3_vl": Family("qwen3_vl", "cpu-qwen3-vl.yaml", ("image", "video"), VISION_LIMITS),
    "qwen2_audio": Family("qwen2_audio", "cpu-audio.yaml", ("audio",), {"audio": 3}),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise SystemExit(f"unknown family {name!r}; one of {', '.join(FAMILIES)}") from None
