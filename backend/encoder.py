"""The vision encoder: a checkpoint's image processor and vision tower, without its language model.

Who calls it: the ``encoder`` model; ``VisionEncoder.load(model_dir)`` once in ``initialize``, then
``encode(images)`` per batch. Items from many requests go through one processor call and one tower
forward (the Qwen2-VL tower attends within each image via ``cu_seqlens``), and the output is split
back per item. The embeddings are what vLLM's language model expects as ``image_embeds``.

Only the tower's tensors are read from the safetensors files (``load_report`` says how many bytes,
against the whole checkpoint).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

TOWER_PREFIXES = ("visual.", "model.visual.")


def model_identity(model_dir: str | Path) -> str:
    """A short fingerprint of a checkpoint (architecture, config and weight files) that producer and
    consumer compare, so embeddings never cross between different models."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(str(path.stat().st_size).encode())
        with open(path, "rb") as fh:  # the safetensors header names every tensor with its offsets
            h.update(fh.read(1 << 16))
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "unknown")
    return f"{model_type}:{h.hexdigest()[:16]}"


@dataclass(frozen=True)
class LoadReport:
    seconds: float
    bytes_read: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class EncodedItem:
    embeddings: torch.Tensor             # [tokens, hidden]
    image_grid_thw: tuple[int, int, int]


class VisionEncoder:
    def __init__(self, tower: torch.nn.Module, processor, merge_size: int, identity: str, report: LoadReport,
                 device: torch.device, dtype: torch.dtype):
        self.tower, self.processor, self.merge_size = tower, processor, merge_size
        self.identity, self.load_report, self.device, self.dtype = identity, report, device, dtype

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> "VisionEncoder":
        from safetensors import safe_open
        from transformers import AutoConfig, AutoImageProcessor

        model_dir = Path(model_dir)
        started = time.perf_counter()
        config = AutoConfig.from_pretrained(model_dir)
        tower_cls = _tower_class(config.model_type)
        dtype = dtype or getattr(torch, str(getattr(config, "dtype", None) or "float32").removeprefix("torch."))
        tower = tower_cls._from_config(config.vision_config)  # non-persistent buffers (rotary) are built here
        state, read = {}, 0
        files = sorted(model_dir.glob("*.safetensors"))
        for path in files:
            with safe_open(path, "pt", device="cpu") as fh:
                for key in fh.keys():
                    prefix = next((p for p in TOWER_PREFIXES if key.startswith(p)), None)
                    if prefix:
                        tensor = fh.get_tensor(key)
                        state[key[len(prefix):]] = tensor
                        read += tensor.numel() * tensor.element_size()
        if not state:
            raise ValueError(f"{model_dir}: no vision-tower tensors (prefixes {TOWER_PREFIXES})")
        tower.load_state_dict(state, strict=True)
        tower = tower.to(device=device, dtype=dtype).eval()
        processor = AutoImageProcessor.from_pretrained(model_dir)
        report = LoadReport(time.perf_counter() - started, read, sum(p.stat().st_size for p in files))
        return cls(tower, processor, config.vision_config.spatial_merge_size, model_identity(model_dir), report,
                   torch.device(device), dtype)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> list[EncodedItem]:
        if not images:
            return []
        batch = self.processor(images=images, return_tensors="pt")
        grid = batch["image_grid_thw"]
        pixels = batch["pixel_values"].to(self.device, self.dtype)
        out = self.tower(pixels, grid_thw=grid.to(self.device))
        embeds = getattr(out, "pooler_output", out)
        sizes = (grid.prod(-1) // (self.merge_size ** 2)).tolist()
        return [EncodedItem(e, tuple(int(x) for x in g)) for e, g in zip(embeds.split(sizes), grid.tolist())]


def _tower_class(model_type: str):
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VisionTransformerPretrainedModel
    raise ValueError(f"no vision tower known for model_type {model_type!r}")
