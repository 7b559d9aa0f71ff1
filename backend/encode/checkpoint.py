"""What identifies a checkpoint's embeddings: the model (``model_identity``) and the image/video processor settings
(``processing_options``), both parts of an item's content key; and reading a tower's tensors out of it
(``read_tensors``, with what that took: ``LoadReport``); the embedding widths its family gives it (``embedding_widths``). Light on purpose (no torch at
import): the orchestrators import it at load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from backend.encode.families import family_for


@dataclass(frozen=True)
class LoadReport:
    """What loading an encoder cost: seconds, the tower's bytes read, and the whole checkpoint's bytes."""

    seconds: float
    bytes_read: int
    checkpoint_bytes: int


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


def processing_options(model_dir: str | Path) -> str:
    """The image (and video) processor settings that change an item's embeddings, as canonical JSON (part of the
    content key). A checkpoint's own video processor config, where it has one, is in it under ``"video"``."""
    path, video = Path(model_dir) / "preprocessor_config.json", Path(model_dir) / "video_preprocessor_config.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    if video.exists():
        doc = {**doc, "video": json.loads(video.read_text())}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def read_tensors(model_dir: Path, prefixes: tuple[str, ...]) -> tuple[dict, int]:
    """The tensors of the checkpoint's safetensors files whose names start with one of ``prefixes`` (the prefix cut
    off), and their bytes: a tower's weights, without reading the rest of the checkpoint."""
    from safetensors import safe_open

    state, read = {}, 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt", device="cpu") as fh:
            for key in fh.keys():
                prefix = next((p for p in prefixes if key.startswith(p)), None)
                if prefix:
                    tensor = fh.get_tensor(key)
                    state[key[len(prefix):]] = tensor
                    read += tensor.numel() * tensor.element_size()
    if not state:
        raise ValueError(f"{model_dir}: no tower tensors (prefixes {prefixes})")
    return state, read


def embedding_widths(model_dir: str | Path) -> dict[str, int]:
    """The width of the media embeddings the checkpoint's language model takes per modality (vLLM's
    ``<modality>_embeds``), from its config.json, by its family's rule (``Family.embedding_widths``: the tower's
    output size, times 1 + the DeepStack levels where the family has them). ``UnknownFamily`` for a ``model_type``
    no family has."""
    doc = json.loads((Path(model_dir) / "config.json").read_text())
    return family_for(doc.get("model_type", "")).embedding_widths(doc)


def embedding_width(model_dir: str | Path) -> int:
    """The one width of the checkpoint's media embeddings (``embedding_widths``), whatever the modality; ValueError
    for a family whose modalities differ in width (their consumers take ``embedding_widths``)."""
    widths = set(embedding_widths(model_dir).values())
    if len(widths) != 1:
        raise ValueError(f"{model_dir}: the media embeddings differ in width per modality ({sorted(widths)})")
    return widths.pop()
