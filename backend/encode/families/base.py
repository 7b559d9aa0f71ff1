"""What a model family is to the server: the ``Family`` record each family module fills in, and the defaults most
families share. The registry (``backend.encode.families``) maps a checkpoint's ``model_type`` to one of them.

A family declares, in one module:

- its towers: a vision tower (``VisionTower``: the transformers class, the checkpoint's tensor prefixes, whether
  ``backend.encode.packed_tower`` implements it) and/or an audio tower (``AudioTower``: the encoder class, its and the
  projector's tensor prefixes). One checkpoint may have both (an omni model);
- how its video processor is called and what timing a video's layout carries (``sample_frames``, ``video_kwargs``,
  ``video_timing``, ``resize_depends_on_frames``): each rule mirrors what vLLM's own processing of that family does
  with the raw video (the ``llm`` baseline), so the embeddings and the prompt built from the layout are the baseline's;
- the width of the embeddings its language model takes, per modality (``embedding_widths``), read from config.json;
- its prompt placeholders where they are not the modality's defaults (``placeholders``, as
  ``backend.request.generate.PromptFormat`` takes them);
- the name of its tiny-checkpoint recipe (``tiny_recipe``: the developers' builders know it by that name; the server
  never imports them).

Light on purpose: nothing here imports torch or transformers at module top (``backend.encode.checkpoint``, which the
orchestrators import at load, asks the registry for widths). The tower classes are imported when a tower is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from backend.protocol.modality import AUDIO, IMAGE, VIDEO


@dataclass(frozen=True)
class VisionTower:
    """A checkpoint's vision tower: ``load_class()`` gives its transformers class (imported on call: transformers is
    a heavy dependency the orchestrators never need); ``prefixes``: its tensors' name prefixes in the safetensors
    files; ``packed``: ``backend.encode.packed_tower`` implements its forward."""

    load_class: Callable[[], type]
    prefixes: tuple[str, ...] = ("visual.", "model.visual.")
    packed: bool = False
    modalities: tuple[str, ...] = (IMAGE.name, VIDEO.name)


@dataclass(frozen=True)
class AudioTower:
    """A checkpoint's audio tower and the projector into the language model's width: ``load_class()`` gives the
    encoder's transformers class; the prefixes name their tensors in the safetensors files."""

    load_class: Callable[[], type]
    prefixes: tuple[str, ...] = ("audio_tower.", "model.audio_tower.")
    projector_prefixes: tuple[str, ...] = ("multi_modal_projector.linear.", "model.multi_modal_projector.linear.")
    modalities: tuple[str, ...] = (AUDIO.name,)
    # the tower takes the items' mel frames unpadded and concatenated with their lengths (``feature_lens``) and
    # projects to the language model's width itself, no projector (Qwen2.5-Omni); else a padded batch with an
    # attention mask, then the projector (Qwen2-Audio)
    packed_features: bool = False


@dataclass(frozen=True)
class Family:
    """One model family, registered by its config's ``model_type``. The methods are the defaults (a family whose
    video processor needs nothing besides the frames, and has no video timing); a family module overrides the ones it
    needs in a subclass."""

    model_type: str
    vision: VisionTower | None = None
    audio: AudioTower | None = None
    placeholders: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # modality -> (token, item text)
    tiny_recipe: str = ""  # the developers' tiny-checkpoint recipe of this family, by name ("": none)
    towers_config: str = ""  # the config.json member holding vision_config, audio_config, text_config ("": the top)

    def tower_config(self, config):
        """The part of ``config`` (a transformers config, or config.json as a mapping) that holds the towers' and
        the language model's configs: ``towers_config``'s member (an omni model's ``thinker_config``), or itself."""
        if not self.towers_config:
            return config
        return config[self.towers_config] if isinstance(config, Mapping) else getattr(config, self.towers_config)

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities the family's towers encode (video: where the checkpoint also has a video processor)."""
        return tuple(m for tower in (self.vision, self.audio) if tower is not None for m in tower.modalities)

    def embedding_widths(self, config: Mapping[str, Any]) -> dict[str, int]:
        """The width of the embeddings the language model takes per modality (vLLM's ``<modality>_embeds``), from
        the checkpoint's config.json (``config``): the tower's output size (``out_hidden_size``; else the language
        model's hidden size), the same for every modality of the family."""
        config = self.tower_config(config)
        width = config_width(config, config.get("vision_config", {}).get("out_hidden_size"))
        return {name: width for name in self.modalities}

    def sample_frames(self, video_processor, video):
        """``video`` (a ``DecodedVideo``) with the frames the family's processor would sample from it, where the
        loader left the sampling to the processor; by default ``video`` itself."""
        return video

    def video_kwargs(self, videos: list) -> dict[str, Any]:
        """What the video processor is called with besides the frames, for decoded ``videos`` (one call for all,
        each already sampled: ``sample_frames``)."""
        return {}

    def video_timing(self, video, temporal_patch_size: int) -> dict[str, Any]:
        """The ``VideoLayout`` timing members of a decoded video (``{}``: the family has none)."""
        return {}

    def resize_depends_on_frames(self, video_processor) -> bool:
        """Whether the video processor sizes a frame by how many frames the video has (then a video part's frames are
        preprocessed with the whole video's): by default where it caps pixels per frame (``cap_pixels_per_frame``)."""
        return bool(getattr(video_processor, "cap_pixels_per_frame", None))

    def tower_output(self, out) -> Any:
        """The embeddings vLLM takes of a transformers vision tower's output: ``pooler_output`` (the merged
        embeddings), with the DeepStack levels' concatenated after it where the tower has them (Qwen3-VL)."""
        import torch  # deferred: a heavy dependency the orchestrators, which read widths here, never need

        merged = getattr(out, "pooler_output", out)
        deepstack = getattr(out, "deepstack_features", None)
        return torch.cat([merged, *deepstack], dim=-1) if deepstack else merged


def config_width(config: Mapping[str, Any], tower_width: int | None) -> int:
    """``tower_width`` (the tower's output size as the config gives it; None: the language model's hidden size),
    times 1 + the DeepStack levels where the config has them (their embeddings are concatenated)."""
    vision = config.get("vision_config", {})
    width = tower_width or config.get("text_config", config).get("hidden_size")
    return int(width) * (1 + len(vision.get("deepstack_visual_indexes") or ()))


def video_metadata(video):
    """The loader's metadata of a decoded video as HF's ``VideoMetadata`` (vLLM drops ``do_sample_frames`` too)."""
    from transformers.video_utils import VideoMetadata  # deferred: heavy, and only the encoder needs it

    return VideoMetadata(**{k: v for k, v in video.metadata.items() if k != "do_sample_frames"})
