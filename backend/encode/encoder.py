"""The vision encoder: a checkpoint's image and video processors and vision tower, without its language model.

Who calls it: the ``encoder`` model; ``VisionEncoder.load(model_dir)`` once in ``initialize``, then
``encode(items)`` per batch. Items from many requests (images, and videos as ``backend.request.video`` decoded
them) go through one processor call per modality and one tower forward (the Qwen2-VL tower attends within each
image, and within each temporal patch of a video, via ``cu_seqlens``), and the output is split back per item. The
embeddings are what vLLM's language model expects as ``image_embeds`` / ``video_embeds``.

A ``VideoPart`` is one slice of a video's temporal patches (``backend.protocol.generate.PART_PARAMETER``): patch
embedding, the 2D rotary positions (h, w) and the 2x2 merger all work within one temporal patch, so the slice's
embeddings are the corresponding rows of the whole video's. Only the slice's frames are preprocessed (frames per
temporal patch: ``temporal_patch_size``) where the video processor resizes a frame without looking at how many
there are (``cap_pixels_per_frame`` off, Qwen2-VL's default); otherwise all frames are, and the rows are cut after.

Only the tower's tensors are read from the safetensors files (``load_report`` says how many bytes,
against the whole checkpoint). What differs per model family (the tower class, packed or not, the video processor's
call, the video timing in the layout, DeepStack's wider output) is asked of its ``Family``, the registry's for the
config's ``model_type`` (``backend.encode.families``). At load the encoder measures its output width with one tiny
forward and checks it against what the checkpoint's language model takes (``checkpoint.embedding_widths``), so a tower
that gives other embeddings fails the load, not a request. ``load_encoder`` gives a family with an audio tower and no
vision tower (Qwen2-Audio) its ``backend.encode.audio.AudioEncoder`` instead, with the same interface.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backend.encode import gpu_image
from backend.encode.audio import AudioEncoder
from backend.encode.checkpoint import LoadReport, embedding_widths, model_identity, read_tensors
from backend.encode.families import Family, family_for
from backend.encode.packed_tower import PackedTower
from backend.encode.tower_graphs import TowerGraphs
from backend.encode.towers import TowersEncoder
from backend.protocol.generate import part_range
from backend.protocol.layout import MODALITY_LAYOUTS, ModalityLayout
from backend.protocol.modality import IMAGE, VIDEO
from backend.request import audio, image, video  # noqa: F401 - register the modalities' handlers

@dataclass(frozen=True)
class EncodedItem:
    embeddings: torch.Tensor             # [tokens, hidden]
    image_grid_thw: tuple[int, int, int]  # the item's patch grid (a video's too; a video part's own)
    modality: str = IMAGE.name
    part: tuple[int, int] | None = None  # a video part's (first temporal patch, the video's count)
    timing: tuple = ()  # a video's VideoLayout timing members, as (name, value) pairs (Family.video_timing)

    def media(self) -> ModalityLayout:
        """The layout's per-modality block of this item."""
        extra = dict(self.timing, part=self.part) if self.part is not None else dict(self.timing)
        return MODALITY_LAYOUTS[self.modality](self.image_grid_thw, **extra)


@dataclass(frozen=True)
class VideoPart:
    """Part ``(i, n)`` of a decoded video (``backend.request.video.DecodedVideo``): its temporal patches
    ``part_range(part, T)``, T the video's."""

    video: object
    part: tuple[int, int]


class VisionEncoder:
    def __init__(self, tower: torch.nn.Module, processor, merge_size: int, identity: str, report: LoadReport,
                 device: torch.device, dtype: torch.dtype, forward=None, video_processor=None,
                 family: Family | None = None):
        self.tower, self.processor, self.merge_size = tower, processor, merge_size
        self.video_processor, self.family = video_processor, family or family_for("qwen2_vl")
        self.model_type = self.family.model_type
        self.identity, self.load_report, self.device, self.dtype = identity, report, device, dtype
        self.forward = forward or _transformers_forward(tower, self.family)
        self._kept_sizes: dict[tuple, bool] = {}  # frame size -> whether the video processor keeps it (keeps_size)

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
             impl: str = "packed", compile: bool = False, cuda_graphs: bool = False) -> "VisionEncoder":
        """``impl``: ``packed`` (``backend.encode.packed_tower``: one varlen-attention pass over the batch) or
        ``transformers`` (the checkpoint's own module, the reference; what a family the packed tower does not
        implement runs, ``VisionTower.packed``); ``compile``: torch.compile the packed blocks (CUDA only);
        ``cuda_graphs``: replay the packed forward as CUDA graphs per bucket of batch shapes
        (``backend.encode.tower_graphs``; CUDA only, with ``compile``)."""
        from transformers import AutoConfig, AutoImageProcessor

        model_dir = Path(model_dir)
        started = time.perf_counter()
        config = AutoConfig.from_pretrained(model_dir)
        family = family_for(config.model_type)
        if family.vision is None:
            raise ValueError(f"the {family.model_type} family has no vision tower")
        dtype = dtype or getattr(torch, str(getattr(config, "dtype", None) or "float32").removeprefix("torch."))
        config = family.tower_config(config)
        tower = family.vision.load_class()._from_config(config.vision_config)  # non-persistent buffers (rotary) are built here
        state, read = read_tensors(model_dir, family.vision.prefixes)
        files = sorted(model_dir.glob("*.safetensors"))
        tower.load_state_dict(state, strict=True)
        if torch.device(device).type == "cuda" and dtype == torch.float32:
            # fp32 means fp32: TF32 convolutions/matmuls (cuDNN's default) move embeddings by ~1e-3
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        tower = tower.to(device=device, dtype=dtype).eval()
        processor = AutoImageProcessor.from_pretrained(model_dir)
        video_processor = load_video_processor(model_dir)
        report = LoadReport(time.perf_counter() - started, read, sum(p.stat().st_size for p in files))
        if impl not in ("packed", "transformers"):
            raise ValueError(f"encoder impl must be 'packed' or 'transformers', not {impl!r}")
        forward = None
        if impl == "packed" and family.vision.packed:
            forward = PackedTower(tower, config.vision_config, compile=compile).to(device)
            if cuda_graphs and compile and torch.device(device).type == "cuda":
                forward = TowerGraphs(forward)
        encoder = cls(tower, processor, config.vision_config.spatial_merge_size, model_identity(model_dir), report,
                      torch.device(device), dtype, forward, video_processor, family)
        encoder.check_width(embedding_widths(model_dir)[IMAGE.name])
        return encoder

    def check_width(self, expected: int) -> None:
        """One forward of a small image and, where the checkpoint has a video processor, a 2-frame video (what the
        first processor call and forward cost, 3-5x a later one, is paid here too): each modality's embeddings must
        be ``expected`` wide (what the language model takes), else ValueError; sets ``width``."""

        items = [Image.new("RGB", (64, 64), (127, 127, 127))]
        if self.video_processor is not None:
            metadata = {"total_num_frames": 2, "fps": 2.0, "duration": 1.0, "frames_indices": [0, 1],
                        "do_sample_frames": False}  # as vLLM's loader gives it (some families read it)
            items.append(video.DecodedVideo(np.full((2, 64, 64, 3), 127, np.uint8), metadata))
        widths = {item.modality: int(item.embeddings.shape[-1]) for item in self.encode(items)}
        self.width = widths[IMAGE.name]
        if set(widths.values()) != {expected}:
            raise ValueError(f"the {self.model_type} vision tower gives embeddings of widths {widths}, the "
                             f"checkpoint's language model takes {expected}")

    @torch.inference_mode()
    def encode(self, items: list) -> list[EncodedItem]:
        """Embeddings of ``items`` (RGB images, ``DecodedVideo``s and ``VideoPart``s, in any mix), in their order: one
        processor call per modality, one tower forward for all (the tower treats a video's temporal patches as it
        treats images)."""
        if not items:
            return []
        items = [self._sampled(item) for item in items]
        images = [i for i, item in enumerate(items) if is_image(item)]
        videos = [i for i, item in enumerate(items) if not is_image(item)]
        pixels, grids, order, parts = [], [], [], {}
        for group in _by_pixels_device(images, items):  # PIL images on the host, uint8 tensors where they are
            image_pixels, image_grid = self._preprocess_images([items[i] for i in group])
            pixels.append(image_pixels)
            grids.append(image_grid)
            order += [(i, IMAGE.name) for i in group]
        if videos:
            if self.video_processor is None:
                raise ValueError("this checkpoint has no video processor")
            for group in _by_frames_device(videos, items):  # each video preprocessed where its frames are
                video_pixels, video_grid = self._preprocess_videos([items[i] for i in group])
                pixels.append(video_pixels)
                grids.append(video_grid)
                order += [(i, VIDEO.name) for i in group]
            parts = {i: part_range(items[i].part, self.temporal_patches(items[i].video))
                     for i in videos if isinstance(items[i], VideoPart)}
        grid = torch.cat(grids)
        embeds = self.forward(torch.cat([p.to(self.device, self.dtype) for p in pixels]), grid)
        sizes = (grid.prod(-1) // (self.merge_size ** 2)).tolist()
        out: list[EncodedItem | None] = [None] * len(items)
        for (index, name), e, g in zip(order, embeds.split(sizes), grid.tolist()):
            part = (parts[index][0], self.temporal_patches(items[index].video)) if index in parts else None
            timing = self._timing(items[index], parts.get(index)) if name == VIDEO.name else ()
            out[index] = EncodedItem(e, tuple(int(x) for x in g), name, part, timing)
        return out

    def _preprocess_images(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One image processor call for ``images``, all PIL images (on the host) or all [3, H, W] uint8 tensors on
        one device (``backend.encode.gpu_image``: resized there with the host's fixed-point kernel, then the
        processor's own ops there: the host's pixels and grids)."""
        if isinstance(images[0], torch.Tensor):
            return gpu_image.preprocess(self.processor, images)
        batch = self.processor(images=images, return_tensors="pt")
        return batch["pixel_values"], batch["image_grid_thw"]

    def _sampled(self, item):
        """A video (or video part) with the frames its processor samples from it (``Family.sample_frames``), so
        that one processor call for many videos treats each as vLLM's per-video call does; images as they are."""
        if is_image(item) or self.video_processor is None:
            return item
        if isinstance(item, VideoPart):
            return VideoPart(self.family.sample_frames(self.video_processor, item.video), item.part)
        return self.family.sample_frames(self.video_processor, item)

    def _preprocess_videos(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One video processor call for ``items`` (videos and video parts whose frames are on one device: the
        processor runs there, on the GPU only where it gives the host's pixels), as vLLM's processing of the family
        calls it (``Family.video_kwargs``); their pixel rows and grids, cut to the parts'."""
        frames, cuts = zip(*(self._frames(item) for item in items))
        decoded = [getattr(item, "video", item) for item in items]
        kwargs = self.family.video_kwargs(decoded)
        if isinstance(frames[0], torch.Tensor) and frames[0].is_cuda and not all(
                self.keeps_size(tuple(f.shape)) for f in frames):
            # torchvision's antialiased resize on CUDA computes in float where the host's is fixed-point uint8: up
            # to 5.8 levels apart (measured on the H200, docs/gpu.md); only frames the processor keeps at their size
            # are preprocessed on the GPU, the others as the CPU path does them
            frames = [f.cpu().numpy() for f in frames]
        batch = self.video_processor(videos=list(frames), return_tensors="pt", **kwargs)
        return _cut(batch["pixel_values_videos"], batch["video_grid_thw"], cuts)

    def keeps_size(self, shape: tuple[int, ...]) -> bool:
        """Whether the video processor keeps frames of ``shape`` ([T, H, W, 3]) at their size (no resize: then its
        ops on the GPU give the host's pixels). A processor that sizes frames by their count (Qwen3-VL) is taken to
        resize. Found once per size by the processor's own call on a black 2-frame clip."""
        vp = self.video_processor
        if self.family.resize_depends_on_frames(vp):
            return False
        if shape[1:3] not in self._kept_sizes:
            probe = np.zeros((vp.temporal_patch_size, *shape[1:3], 3), np.uint8)
            _, h, w = vp(videos=[probe], return_tensors="pt")["video_grid_thw"][0].tolist()
            self._kept_sizes[shape[1:3]] = (h * vp.patch_size, w * vp.patch_size) == tuple(shape[1:3])
        return self._kept_sizes[shape[1:3]]

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities this encoder takes (video: where the checkpoint has a video processor)."""
        return (IMAGE.name, VIDEO.name) if self.video_processor is not None else (IMAGE.name,)

    def warm_up(self) -> None:
        """A compiled packed tower compiles its blocks on the first batch of ``COMPILE_MIN_TOKENS`` patches or more
        (6-7 s on the H200, seen as TTFT outliers of the first requests that reached each of 4 encoder instances):
        pay that here (``PackedTower.warm_up``: the tower fed that many patches directly, since a processor that
        caps an item's pixels may never make one item that large: the tiny checkpoint's first batch of 8 videos
        compiled at 5-9 s on the H200). ``check_width`` at load paid the first processor calls."""
        if getattr(self.forward, "compile", False) and self.device.type == "cuda":
            self.forward.warm_up()

    def _timing(self, item, cut: tuple[int, int] | None) -> tuple:
        """A video's (or video part's: ``cut``, its temporal patches) timing members for its layout."""
        whole = getattr(item, "video", item)
        timing = self.family.video_timing(whole, self.video_processor.temporal_patch_size)
        if cut is not None and "timestamps" in timing:
            timing["timestamps"] = timing["timestamps"][cut[0]:cut[1]]
        return tuple(timing.items())

    def temporal_patches(self, video) -> int:
        """A decoded video's grid t: its frames over ``temporal_patch_size``, rounded up (the processor pads)."""
        size = self.video_processor.temporal_patch_size
        return -(-len(video.frames) // size)

    def _frames(self, item):
        """The frames to preprocess for a video or a video part, and the temporal patches ``(first, stop)`` to cut
        out of the result afterwards (None: all of it)."""
        if not isinstance(item, VideoPart):
            return item.frames, None
        first, stop = part_range(item.part, self.temporal_patches(item.video))
        if self.family.resize_depends_on_frames(self.video_processor):  # the frame count changes each frame's size
            return item.video.frames, (first, stop)
        size = self.video_processor.temporal_patch_size
        return item.video.frames[first * size: stop * size], None


def load_encoder(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None, impl: str = "packed",
                 compile: bool = False, cuda_graphs: bool = False):
    """The checkpoint's encoder: its audio tower's (``backend.encode.audio.AudioEncoder``) for a family with an
    audio tower and no vision tower (Qwen2-Audio), its vision tower's (``VisionEncoder.load``) for one without an
    audio tower, both behind a ``backend.encode.towers.TowersEncoder`` for a family with both (Qwen2.5-Omni); the
    family is the registry's for the config's ``model_type`` (``UnknownFamily`` if none)."""
    from transformers import AutoConfig  # deferred: heavy, as everywhere in this module's loaders

    family = family_for(AutoConfig.from_pretrained(model_dir).model_type)
    if family.vision is None and family.audio is not None:
        return AudioEncoder.load(model_dir, device=device, dtype=dtype)
    vision = VisionEncoder.load(model_dir, device=device, dtype=dtype, impl=impl, compile=compile,
                                cuda_graphs=cuda_graphs)
    if family.audio is None:
        return vision
    return TowersEncoder([vision, AudioEncoder.load(model_dir, device=device, dtype=dtype)])


def is_image(item) -> bool:
    """Whether a decoded item is an image: a PIL image, or a [3, H, W] uint8 tensor (``image_preprocess: gpu``)."""
    return isinstance(item, Image.Image) or (isinstance(item, torch.Tensor) and item.dim() == 3
                                             and item.dtype == torch.uint8)


def _by_pixels_device(images: list[int], items: list) -> list[list[int]]:
    """The indices ``images`` of ``items`` grouped by where their pixels are (PIL images first, then the tensors of
    each device), in order within a group."""
    return _by_device(images, [items[i] for i in images])


def _by_frames_device(videos: list[int], items: list) -> list[list[int]]:
    """The indices ``videos`` of ``items`` grouped by where their frames are (host arrays first, then each CUDA
    device's tensors), in order within a group: NVDEC's frames are preprocessed on the GPU, a CPU decoder's on the
    host, whatever else is in the batch (so a video's pixels never depend on its batch)."""
    return _by_device(videos, [getattr(items[i], "video", items[i]).frames for i in videos])


def _by_device(indices: list[int], data: list) -> list[list[int]]:
    """``indices`` grouped by the device of their ``data`` (host objects first, then each device's tensors)."""
    groups: dict[str, list[int]] = {}
    for i, value in zip(indices, data):
        groups.setdefault(str(value.device) if isinstance(value, torch.Tensor) else "", []).append(i)
    return [groups[key] for key in sorted(groups)]


def _cut(pixels: torch.Tensor, grid: torch.Tensor, cuts) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and grid rows of the temporal patches ``cuts[k]`` (``(first, stop)``, None: all) of each video k of
    a processor's output (a video's rows: t groups of h*w patches, in order)."""
    if all(cut is None for cut in cuts):
        return pixels, grid
    rows, thw, offset = [], [], 0
    for (t, h, w), cut in zip(grid.tolist(), cuts):
        first, stop = cut or (0, t)
        rows.append(pixels[offset + first * h * w: offset + stop * h * w])
        thw.append([stop - first, h, w])
        offset += t * h * w
    return torch.cat(rows), torch.tensor(thw, dtype=grid.dtype)


def load_video_processor(model_dir: Path):
    """The checkpoint's video processor (as vLLM's HF processor loads it), or None where it has none."""
    from transformers import AutoVideoProcessor

    try:
        return AutoVideoProcessor.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def _transformers_forward(tower, family: Family):
    def forward(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return family.tower_output(tower(pixels, grid_thw=grid.to(pixels.device)))
    return forward
