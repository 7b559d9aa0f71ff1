"""What a consumer gives vLLM for a request's layouts: per modality, its embeddings (pulled by
``backend.transfer.consumer.EmbeddingConsumer``, or zeros for a KV consumer that needs only their shape), the grids
or token counts and the family's video timing, with a video split across encoders joined back into one item
(``media_grids`` checks the parts make up their video).
"""
from __future__ import annotations

import collections
from typing import Any

import torch

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import AudioLayout, GridLayout, VideoLayout
from backend.protocol.modality import modality
from backend.transfer.consumer import EmbeddingConsumer
from backend.transfer.held import HeldEmbeddings
from backend.transfer.same_host import DTYPES


def pull_media_embeds(consumer: EmbeddingConsumer, layouts, copies=None, held: "HeldEmbeddings | None" = None,
                      session: str | None = None) -> dict[str, tuple]:
    """Pull every item of a request in one ``pull_many``: per modality, in prompt order, (embeddings, grid) as vLLM's
    ``<modality>_embeds`` input wants them: concatenated [tokens, hidden] with grid_thw [items, 3], or, for a modality
    vLLM takes item by item (``Modality.embeds_per_item``: audio), a list of [tokens, hidden] with the token counts
    [items]. A failed pull is ``Unavailable`` naming the item as its modality's layouts tensor does
    (``video_layouts[i]: ...``). ``copies``: per layout, the consumer's own copy to use instead of pulling it, or
    None (``HeldEmbeddings.take``); ``held``: where the pulled ones are kept for later requests (of ``session``)."""
    grids, names = media_grids(layouts), media_fields(layouts)
    embeds = list(copies) if copies is not None else [None] * len(layouts)
    wanted = [i for i, tensor in enumerate(embeds) if tensor is None]
    pulled = consumer.pull_many([layouts[i] for i in wanted], [names[i] for i in wanted]) if wanted else []
    for i, tensor in zip(wanted, pulled):
        embeds[i] = tensor
        if held is not None:
            held.put(layouts[i], tensor, session)
    return {name: (_joined(name, [e for e, layout in zip(embeds, layouts) if layout.modality == name]), grid)
            for name, grid in grids.items()}


def placeholder_media_embeds(layouts) -> dict[str, object]:
    """Per modality, zeros of a request's embeddings' shape and dtype (joined as ``pull_media_embeds`` gives them),
    for a KV consumer whose KV already covers the media positions on a vLLM that needs the tensor anyway
    (``backend.engine.host.takes_layout_only``); nothing is pulled."""
    return {name: _joined(name, [torch.zeros(layout.shape, dtype=DTYPES[layout.dtype]) for layout in layouts
                                 if layout.modality == name])
            for name in media_grids(layouts)}


def _joined(name: str, tensors: list[torch.Tensor]):
    """One modality's item embeddings in vLLM's form: a list (``Modality.embeds_per_item``), else concatenated."""
    if modality(name).embeds_per_item:
        return tensors
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


def media_fields(layouts) -> list[str]:
    """Each layout's field: ``<modality's layouts tensor>[i]``, ``i`` its index among the layouts of its modality."""
    seen: dict[str, int] = collections.Counter()
    fields = []
    for layout in layouts:
        fields.append(f"{modality(layout.modality).layout_tensor}[{seen[layout.modality]}]")
        seen[layout.modality] += 1
    return fields


def media_grids(layouts) -> dict[str, torch.Tensor]:
    """Per modality, in order of first appearance, the grids of its items, [items, 3] (vLLM's
    ``<modality>_grid_thw``), or an audio's token counts, [items] (``audio_num_tokens``); a layout with neither is
    InvalidInput naming it (``<field>.modality``). Consecutive
    parts of one video (``VideoLayout.part``) are one item, one row (sum of their t, h, w), as their embeddings,
    concatenated in order, are the video's; parts that leave a gap, overlap, stop short of the video's end or
    differ in h, w or the video's length are InvalidInput naming the part at fault (``video_layouts[k]``)."""
    grids: dict[str, list] = {}
    open_part: dict[str, tuple[str, VideoLayout]] = {}  # modality -> (field, layout) of a video's latest part
    for field, layout in zip(media_fields(layouts), layouts):
        if isinstance(layout.media, AudioLayout):
            grids.setdefault(layout.modality, []).append(layout.media.num_tokens)
            continue
        if not isinstance(layout.media, GridLayout):
            raise InvalidInput(f"{field}.modality", f"expected an image, video or audio layout, got {layout.modality!r}")
        rows = grids.setdefault(layout.modality, [])
        part = getattr(layout.media, "part", None)
        last = open_part.pop(layout.modality, None)
        if part is None or part[0] == 0:
            if last is not None:
                _incomplete(*last)
            rows.append(list(layout.media.grid_thw))
        else:
            _check_next_part(field, layout.media, last, rows[-1] if last is not None else None)
            rows[-1][0] += layout.media.grid_thw[0]
        if part is not None and part[0] + layout.media.grid_thw[0] < part[1]:
            open_part[layout.modality] = (field, layout.media)
    for last in open_part.values():
        _incomplete(*last)
    return {name: torch.tensor(rows, dtype=torch.int64) for name, rows in grids.items()}


def media_uuids(layouts) -> dict[str, tuple[str, ...]]:
    """Per modality, each item's id for vLLM (``multi_modal_uuids``): its content key; a video in parts (one item,
    ``media_grids``) joins its parts' keys with "+"."""
    out: dict[str, list[str]] = {}
    for layout in layouts:
        part = getattr(layout.media, "part", None)
        keys = out.setdefault(layout.modality, [])
        if part is None or part[0] == 0 or not keys:
            keys.append(layout.content_key)
        else:
            keys[-1] += "+" + layout.content_key
    return {name: tuple(keys) for name, keys in out.items()}


TIMING = ("second_per_grid_ts", "timestamps")  # the VideoLayout members that are vLLM fields of the same name


def media_kwargs(layouts) -> dict[str, dict[str, Any]]:
    """Per modality, the items' fields vLLM takes beside ``<modality>_embeds`` and the grid (``TIMING``), where its
    layouts carry them: ``second_per_grid_ts`` as a float32 tensor [items] (as the HF processor gives it),
    ``timestamps`` as a list per item. A video in parts (checked by ``media_grids``) is one item: its first part's
    ``second_per_grid_ts``, its parts' timestamps in order. Items of a modality must all carry a field or none
    (else InvalidInput naming the first without it)."""
    items: dict[str, list[tuple[str, dict]]] = {}
    for field, layout in zip(media_fields(layouts), layouts):
        part = getattr(layout.media, "part", None)
        rows = items.setdefault(layout.modality, [])
        if part is None or part[0] == 0 or not rows:
            rows.append((field, {}))
        row = rows[-1][1]
        for name in TIMING:
            value = getattr(layout.media, name, None)
            if value is not None:
                row[name] = row.get(name, ()) + value if name == "timestamps" else row.get(name, value)
    out: dict[str, dict[str, Any]] = {}
    for name, rows in items.items():
        for key in TIMING:
            have = [row.get(key) for _, row in rows]
            if all(v is None for v in have):
                continue
            if None in have:
                raise InvalidInput(f"{rows[have.index(None)][0]}.{name}.{key}", "missing where the request's other "
                                                                               f"{name} items have it")
            out.setdefault(name, {})[key] = torch.tensor(have, dtype=torch.float32) if key == "second_per_grid_ts" \
                else [list(v) for v in have]
    return out


def _check_next_part(field: str, media: VideoLayout, last: tuple[str, VideoLayout] | None, row: list | None) -> None:
    """``media``, a part that does not start a video, must continue the open one (``last``; ``row``: its grid so far)."""
    first, total = media.part
    if last is None:
        raise InvalidInput(field, f"video part starting at temporal patch {first} of {total} follows no part of its "
                                  "video (parts out of order or missing)")
    if first != row[0] or total != last[1].part[1]:
        raise InvalidInput(field, f"video part starting at temporal patch {first} of {total} does not continue "
                                  f"{last[0]} (which ends at {row[0]} of {last[1].part[1]}): parts out of order or "
                                  "missing")
    if media.grid_thw[1:] != last[1].grid_thw[1:]:
        raise InvalidInput(field, f"video part of grid {list(media.grid_thw)} does not match {last[0]}'s "
                                  f"h, w {list(last[1].grid_thw[1:])}")


def _incomplete(field: str, media: VideoLayout) -> None:
    first, total = media.part
    raise InvalidInput(field, f"video parts stop at temporal patch {first + media.grid_thw[0]} of {total}: the "
                              "video's later parts are missing")
