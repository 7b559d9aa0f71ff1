"""The audio encoder: a checkpoint's audio feature extractor, audio tower and projector, without its language model
(Qwen2-Audio: ``WhisperFeatureExtractor``, transformers' ``Qwen2AudioEncoder`` and the ``multi_modal_projector``
linear layer, the modules vLLM's ``Qwen2AudioForConditionalGeneration`` runs, read from the same safetensors files).

Who calls it: the ``encoder`` model, through ``backend.encode.encoder.load_encoder``, which picks this class for a
family with an audio tower and no vision tower (its ``Family.audio``: the tower class and the tensors' prefixes); then ``encode(items)`` per batch, as ``VisionEncoder``'s. Items
(``backend.request.audio.DecodedAudio``: mono samples at the extractor's rate) of many requests go through one
feature-extractor call and one tower forward: each item is padded to the extractor's window (30 s: 3000 mel frames)
and masked past its own frames, as vLLM's ``_process_audio_input`` does, so an item's embeddings are its own rows of
the output ([tokens, hidden], tokens from the kept mel frames: ``((frames - 1) // 2 + 1 - 2) // 2 + 1``). The layout
block carries the token count and the feature length (``backend.protocol.layout.AudioLayout``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.encode.checkpoint import LoadReport, embedding_widths, model_identity, read_tensors
from backend.encode.families import family_for
from backend.protocol.errors import InvalidInput
from backend.protocol.layout import AudioLayout
from backend.protocol.modality import AUDIO, modality
from backend.request.audio import DecodedAudio
from backend.request.media import modality_of

@dataclass(frozen=True)
class EncodedAudio:
    """One audio item's embeddings [tokens, hidden] and the mel frames they come from."""

    embeddings: torch.Tensor
    feature_length: int
    modality: str = AUDIO.name

    def media(self) -> AudioLayout:
        """The layout's per-modality block of this item."""
        return AudioLayout(int(self.embeddings.shape[0]), self.feature_length)


class AudioEncoder:
    video_processor = None  # what the encoder model asks a VisionEncoder: an audio checkpoint has none
    modalities = (AUDIO.name,)

    def __init__(self, tower: torch.nn.Module, projector: torch.nn.Module, features, identity: str, report,
                 device: torch.device, dtype: torch.dtype, packed_features: bool = False):
        self.tower, self.projector, self.features = tower, projector, features
        self.packed_features = packed_features
        self.identity, self.load_report, self.device, self.dtype = identity, report, device, dtype

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> "AudioEncoder":
        """The audio tower and projector of ``model_dir`` (their tensors only are read), in ``dtype`` (None: the
        checkpoint's), on ``device``."""
        from transformers import AutoConfig, AutoFeatureExtractor  # deferred: heavy

        model_dir = Path(model_dir)
        started = time.perf_counter()
        config = AutoConfig.from_pretrained(model_dir)
        family = family_for(config.model_type)
        if family.audio is None:
            raise ValueError(f"the {family.model_type} family has no audio tower")
        dtype = dtype or getattr(torch, str(getattr(config, "dtype", None) or "float32").removeprefix("torch."))
        config = family.tower_config(config)
        tower = family.audio.load_class()(config.audio_config)  # as vLLM builds it (its attention implementation too)
        projector = torch.nn.Linear(config.audio_config.d_model, config.text_config.hidden_size, bias=True) \
            if family.audio.projector_prefixes else torch.nn.Identity()  # a tower that projects itself: none
        read = 0
        for module, prefixes in ((tower, family.audio.prefixes), (projector, family.audio.projector_prefixes)):
            if not prefixes:
                continue
            state, nbytes = read_tensors(model_dir, prefixes)
            module.load_state_dict(state, strict=True)
            read += nbytes
        tower, projector = (m.to(device=device, dtype=dtype).eval() for m in (tower, projector))
        files = sorted(model_dir.glob("*.safetensors"))
        report = LoadReport(time.perf_counter() - started, read, sum(p.stat().st_size for p in files))
        encoder = cls(tower, projector, AutoFeatureExtractor.from_pretrained(model_dir), model_identity(model_dir),
                      report, torch.device(device), dtype, family.audio.packed_features)
        encoder.check_width(embedding_widths(model_dir)[AUDIO.name])
        return encoder

    @torch.inference_mode()
    def encode(self, items: list) -> list[EncodedAudio]:
        """Embeddings of ``items`` (``DecodedAudio``s), in their order: one feature-extractor call, one tower
        forward."""
        if not items:
            return []
        for item in items:
            if not isinstance(item, DecodedAudio):
                m = modality(modality_of(item))
                raise InvalidInput(m.media_tensor, f"this checkpoint's encoder takes audio only, not an {m.name}")
        batch = self.features([item.samples for item in items], sampling_rate=self.features.sampling_rate,
                              truncation=True, return_attention_mask=True, padding="max_length", return_tensors="pt")
        frames = batch["attention_mask"].sum(-1)
        conv_lengths, tokens = self.tower._get_feat_extract_output_lengths(frames)
        features = batch["input_features"].to(self.device, self.dtype)
        embeds = self._packed(features, batch["attention_mask"], frames, conv_lengths, tokens) \
            if self.packed_features else self.projector(self._padded(features, conv_lengths))
        out = []
        for row, count, length in zip(embeds, tokens.tolist(), frames.tolist()):
            if count <= 0:
                raise InvalidInput(AUDIO.media_tensor, f"audio of {length} feature frames is too short for a token")
            out.append(EncodedAudio(row[:count].contiguous(), int(length)))
        return out

    def _padded(self, features: torch.Tensor, conv_lengths: torch.Tensor) -> torch.Tensor:
        """The tower's output for a padded batch [items, mel, frames], masked past each item's frames (Qwen2-Audio,
        as vLLM's ``_process_audio_input``): [items, positions, hidden]."""
        mask = _padding_mask(conv_lengths, features.shape[-1], self.device, self.dtype)
        return self.tower(features, attention_mask=mask).last_hidden_state

    def _packed(self, features, mask, frames, conv_lengths, tokens) -> list[torch.Tensor]:
        """The tower's output for the items' kept mel frames concatenated [mel, sum of frames] with their lengths
        (Qwen2.5-Omni, as vLLM's ``_process_audio_input``: the feature attention mask unpads them), split per item."""
        flat = features.permute(0, 2, 1)[mask.bool().to(features.device)].permute(1, 0)
        hidden = self.tower(flat, feature_lens=frames.to(self.device), aftercnn_lens=conv_lengths.to(self.device))
        return list(hidden.last_hidden_state.split(tokens.tolist()))

    def temporal_patches(self, video) -> int:
        raise InvalidInput(AUDIO.media_tensor, "this checkpoint's encoder takes audio only, not a video")

    def check_width(self, expected: int) -> None:
        """One encode of a second of silence (what the first feature extraction and forward cost, several later ones,
        is paid here too): the embeddings must be ``expected`` wide (what the language model takes), else ValueError;
        sets ``width``."""
        import numpy as np

        rate = self.features.sampling_rate
        self.width = int(self.encode([DecodedAudio(np.zeros(rate, np.float32), rate)])[0].embeddings.shape[-1])
        if self.width != expected:
            raise ValueError(f"the audio tower gives {self.width}-wide embeddings, the checkpoint's language model "
                             f"takes {expected}")

    def warm_up(self) -> None:
        """Nothing to compile (``VisionEncoder.warm_up``'s counterpart): ``check_width`` at load paid the first calls."""


def _padding_mask(lengths: torch.Tensor, mel_frames: int, device, dtype) -> torch.Tensor:
    """The tower's additive attention mask [items, 1, S, S] (S: positions after the strided convolution): -inf at
    the keys past each item's ``lengths``, as vLLM's Qwen2-Audio builds it."""
    positions = (mel_frames - 2) // 2 + 1
    padded = torch.arange(positions, device=lengths.device).unsqueeze(0) >= lengths.unsqueeze(-1)
    padded = padded.view(len(lengths), 1, 1, positions).expand(len(lengths), 1, positions, positions)
    mask = torch.zeros(padded.shape, dtype=dtype, device=device)
    return mask.masked_fill(padded.to(device), float("-inf"))


__all__ = ["AudioEncoder", "EncodedAudio"]
