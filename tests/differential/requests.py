"""A case as the requests a client sends: over Triton's gRPC generate (``grpc_request``: ``GenerateInputs``, media
as tensors or data URLs as the case says) and through the OpenAI endpoint (``openai_request``: tensor items inlined
as data URLs, which ask the same question; None where the endpoint cannot say it: a ``text_input`` with media, an
item no part takes). ``expected_field`` is the field an invalid case's refusal must start with, per route."""
from __future__ import annotations

import base64
from dataclasses import dataclass, field

from backend.protocol.generate import GenerateInputs
from backend.protocol.modality import modalities, modality
from tests.differential import media
from tests.differential.cases import Case, Item
from tests.differential.families import FAMILIES

BAD_BASE64 = "@@not*base64@@"
FAMILY_PARTS = {m.item_part for m in modalities()}  # {"type": "image"}: a part that takes a tensor item


@dataclass
class Built:
    """A case's request on one route: ``inputs`` (gRPC) or ``path`` and ``body`` (OpenAI), and the field its
    refusal must name (None: the case is valid)."""

    route: str
    inputs: GenerateInputs | None = None
    path: str = ""
    body: dict = field(default_factory=dict)
    expect: str | None = None
    fields: dict[str, str] = field(default_factory=dict)  # a gRPC tensor item's field -> its field here (inlined)


def item_bytes(item: Item) -> bytes:
    data = media.build(item.modality, item.spec)
    return media.broken(data, item.broken) if item.broken not in (None, "bad_base64") else data


def _part(item: Item, form: str) -> dict:
    """The chat content part of ``item`` given as ``form`` (``url`` or ``data``; ``item`` parts take a tensor)."""
    if form == "item":
        return {"type": item.modality}
    m = modality(item.modality)
    if form == "data":
        data = BAD_BASE64 if item.broken == "bad_base64" else base64.b64encode(item_bytes(item)).decode()
        return {"type": m.data_part, m.data_part: {"data": data, "format": item.spec["fmt"].lower()}}
    mime = media.mime(item.modality, item.spec)
    url = f"data:{mime};base64,{BAD_BASE64}" if item.broken == "bad_base64" else media.data_url(mime, item_bytes(item))
    return {"type": m.url_part, m.url_part: {"url": url}}


def _field_of(item: Item, form: str, where: str, tensor_index: int) -> str:
    if form == "item":
        return f"{modality(item.modality).media_tensor}[{tensor_index}]"
    m = modality(item.modality)
    return f"{where}.{m.data_part}.data" if form == "data" else f"{where}.{m.url_part}"


def _messages(case: Case, inline: bool, fields: dict[str, str] | None = None
              ) -> tuple[list[dict], dict[str, list[bytes]], list[tuple[str, str]]]:
    """The chat messages, the tensors they take per modality, and (kind, field) of every spot a refusal may name, in
    the order the server checks them. ``inline``: tensor items become data URLs (the OpenAI route), and ``fields``
    gets each one's gRPC field (``video[0]``) -> its field inlined (``messages[0].content[1].video_url``)."""
    tensors: dict[str, list[bytes]] = {m.name: [] for m in modalities()}
    was_tensor = {m.name: 0 for m in modalities()}
    spots: list[tuple[str, str]] = []
    messages = []
    for i, turn in enumerate(case.turns):
        where = f"messages[{i}]"
        if turn["role"] not in ("system", "user", "assistant"):
            spots.append(("bad_role", f"{where}.role"))
        if turn.get("string"):
            messages.append({"role": turn["role"], "content": turn["parts"][0]["text"]})
            continue
        content = []
        for j, part in enumerate(turn["parts"]):
            at = f"{where}.content[{j}]"
            if "text" in part:
                content.append({"type": "text", "text": part["text"]})
            elif "raw" in part:
                content.append(dict(part["raw"]))
                spots.append(("raw", f"{at}.type" if part["raw"]["type"] not in FAMILY_PARTS else at))
            else:
                item = case.items[part["item"]]
                form = "url" if inline and item.form == "item" else item.form
                if inline and item.form == "item" and fields is not None:
                    fields[f"{modality(item.modality).media_tensor}[{was_tensor[item.modality]}]"] = \
                        f"{at}.{modality(item.modality).url_part}"
                    was_tensor[item.modality] += 1
                content.append(_part(item, form))
                if form == "item":
                    tensors[item.modality].append(item_bytes(item))
                if item.broken:
                    spots.append(("broken", _field_of(item, form, at, len(tensors[item.modality]) - 1)))
        messages.append({"role": turn["role"], "content": content})
    return messages, tensors, spots


def _sampling_field(case: Case) -> str | None:
    """``sampling_parameters.<key>`` of the spoilt sampling parameter (``bad_sampling``)."""
    from tests.differential.invalid import BAD_SAMPLING

    for spoilt in BAD_SAMPLING:
        if case.invalid == "bad_sampling" and all(case.sampling.get(k) == v for k, v in spoilt.items()):
            return f"sampling_parameters.{next(iter(spoilt))}"
    return None


def _limit_field(case: Case, tensors: dict[str, list[bytes]]) -> str | None:
    """The field of the one modality over its limit (``too_many``): its tensor when the tensors are over it (checked
    before anything else), else ``messages`` (the parts are counted once parsed)."""
    fam = FAMILIES[case.family]
    for name, limit in fam.limits.items():
        if sum(i.modality == name for i in case.items) > limit:
            return modality(name).media_tensor if len(tensors[name]) > limit else "messages"
    return None


def _prompt_field(case: Case) -> str | None:
    """The field ``_text_prompt`` names when the prompt's placeholders do not match the items (None: they match, or
    it names none and the server puts them in front)."""
    counts = {m: sum(i.modality == m.name for i in case.items) for m in modalities()}
    found = {m: case.prompt.count(m.placeholder_token) for m in counts}
    if not any(found.values()):
        return None
    for m, count in counts.items():
        if found[m] != count:
            return m.media_tensor if count else "text_input"
    return None


def expected_field(case: Case, tensors: dict[str, list[bytes]], spots: list[tuple[str, str]]) -> str | None:
    """The field the refusal of ``case`` names on a route (None: valid). A case has one fault (``invalid``): the
    field follows from it, and, for the faults at a place in the request, from where it is there (``spots``)."""
    if not case.invalid:
        return None
    if case.invalid == "too_many":
        return _limit_field(case, tensors)
    if case.invalid == "bad_sampling":
        return _sampling_field(case)
    if case.invalid == "placeholder_mismatch":
        return _prompt_field(case)
    if case.invalid == "unreferenced_item":
        return modality(case.extra[0].modality).media_tensor
    return spots[0][1]  # broken media, bad base64, an unknown part, an item part with no item, an unknown role


def _prompt_tensors(case: Case) -> tuple[dict[str, list[bytes]], list[tuple[str, str]]]:
    tensors: dict[str, list[bytes]] = {m.name: [] for m in modalities()}
    spots = []
    for item in case.items:
        tensors[item.modality].append(item_bytes(item))
        if item.broken:
            spots.append(("broken", _field_of(item, "item", "", len(tensors[item.modality]) - 1)))
    return tensors, spots


def grpc_request(case: Case) -> Built:
    """``case`` over Triton's generate interface, asking for the sampled tokens' ids too (``logprobs`` 0: their
    entries), which the comparison takes beside the text (a random checkpoint's text is often bytes that form no
    character, the same U+FFFD for different tokens)."""
    if case.kind == "chat":
        messages, tensors, spots = _messages(case, inline=False)
        for item in case.extra:
            tensors[item.modality].append(item_bytes(item))
        text = {"messages": messages}
    else:
        tensors, spots = _prompt_tensors(case)
        text = {"prompt": case.prompt}
    inputs = GenerateInputs(**text, images=tensors["image"], videos=tensors["video"], audios=tensors["audio"],
                            sampling={**case.sampling, "logprobs": 0}, stream=case.stream,
                            parameters={"epd_error_codes": True})
    return Built("grpc", inputs=inputs, expect=expected_field(case, tensors, spots))


def openai_request(case: Case) -> Built | None:
    """``case`` through the OpenAI endpoint (tensor items as data URLs), or None where it has no such request."""
    body = {"stream": case.stream, **({"stream_options": {"include_usage": True}} if case.stream else {}),
            **case.sampling}
    if case.kind == "chat" and not case.extra:
        fields: dict[str, str] = {}
        messages, tensors, spots = _messages(case, inline=True, fields=fields)
        return Built("openai", path="/v1/chat/completions", body={**body, "messages": messages},
                     expect=expected_field(case, tensors, spots), fields=fields)
    if case.kind in ("prompt", "text") and not case.items:
        tensors, spots = _prompt_tensors(case)
        return Built("openai", path="/v1/completions", body={**body, "prompt": case.prompt},
                     expect=expected_field(case, tensors, spots))
    return None
