import json
import time

import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import (SCHEMA_VERSION, TRANSPORTS, CudaIpcHandle, ImageLayout, LayoutMetadata, NixlHandle,
                                     SharedMemoryHandle, TransferHandle)

COMMON = dict(agent_name="enc-1", agent_metadata=b"\x00meta\xff", descriptors=b"descs", lease_id="00ab",
              nbytes=4 * 128 * 4, expires_at=time.time() + 30, host="boot/ns", pid=1234)
HANDLES = {
    "nixl": NixlHandle(**COMMON),
    "shared_memory": SharedMemoryHandle(**COMMON, shm_path="/proc/1234/fd/7", offset=4096),
    "cuda_ipc": CudaIpcHandle(**COMMON, ipc_handle="ab" * 64, pool_bytes=1 << 20, offset=128,
                              tag_table="/proc/1234/fd/9", tag_slot=3),
}


def layout(transport: str = "shared_memory", **overrides) -> LayoutMetadata:
    fields = dict(content_key="k1", model="qwen2_vl:abc", dtype="float32", shape=(4, 128), handle=HANDLES[transport],
                  media=ImageLayout((1, 4, 4)))
    return LayoutMetadata(**{**fields, **overrides})


@pytest.mark.parametrize("transport", list(HANDLES))
def test_round_trip_is_plain_json_with_numeric_arrays(transport):
    original = layout(transport)
    text = original.to_json()
    doc = json.loads(text)
    assert doc["version"] == SCHEMA_VERSION and doc["shape"] == [4, 128] and doc["image"] == {"grid_thw": [1, 4, 4]}
    assert doc["modality"] == "image" and "image_grid_thw" not in doc
    assert doc["handle"]["transport"] == transport and type(original.handle) is TRANSPORTS[transport]
    parsed = LayoutMetadata.from_json(text, "image_layouts[0]", expected_model="qwen2_vl:abc")
    assert parsed == original and type(parsed.handle) is type(original.handle)
    assert parsed.modality == "image" and parsed.media.grid_thw == (1, 4, 4)


def test_each_transport_carries_only_its_own_fields():
    docs = {transport: handle.to_doc() for transport, handle in HANDLES.items()}
    common = {"transport", *(name for name in COMMON)}
    assert set(docs["nixl"]) == common
    assert set(docs["shared_memory"]) == common | {"shm_path", "offset"}
    assert set(docs["cuda_ipc"]) == common | {"ipc_handle", "pool_bytes", "offset", "tag_table", "tag_slot"}
    assert docs["nixl"]["agent_metadata"] == "AG1ldGH/"  # base64 of the NIXL blob
    for transport, doc in docs.items():
        assert TransferHandle.from_doc(doc, "announcement") == HANDLES[transport]


def test_the_common_part_is_no_handle_of_its_own():
    with pytest.raises(TypeError, match="no transport's handle"):
        TransferHandle(**COMMON)


@pytest.mark.parametrize("mutate, field, fragment", [
    (lambda d: d.update(version=2), "image_layouts[0].version", "unsupported layout schema version 2"),
    (lambda d: d.update(version=SCHEMA_VERSION - 1), "image_layouts[0].version", "older than this consumer's"),
    (lambda d: d.update(version=SCHEMA_VERSION + 1), "image_layouts[0].version", "newer than this consumer's"),
    (lambda d: d.pop("version"), "image_layouts[0].version", "no layout schema version"),
    (lambda d: d.update(version=str(SCHEMA_VERSION)), "image_layouts[0].version", "unsupported layout schema version"),
    (lambda d: d.update(model="other:1"), "image_layouts[0].model", "this consumer serves"),
    (lambda d: d.update(dtype="int8"), "image_layouts[0].dtype", "unsupported dtype"),
    (lambda d: d.update(shape=[4]), "image_layouts[0].shape", "tokens, hidden"),
    (lambda d: d.update(modality="speech"), "image_layouts[0].modality", "unsupported modality 'speech'"),
    (lambda d: d.update(modality="audio"), "image_layouts[0].audio", "no audio block"),
    (lambda d: d.pop("image"), "image_layouts[0].image", "no image block"),
    (lambda d: d["image"].update(grid_thw=[1, 0, 4]), "image_layouts[0].image.grid_thw", "positive"),
    (lambda d: d["image"].update(grid_thw=[1, 4]), "image_layouts[0].image.grid_thw", "positive"),
    (lambda d: d["image"].pop("grid_thw"), "image_layouts[0].image.grid_thw", "positive"),
    (lambda d: d["handle"].update(nbytes=3), "image_layouts[0].handle.nbytes", "does not match"),
    (lambda d: d["handle"].pop("lease_id"), "image_layouts[0].handle.lease_id", "malformed transfer handle"),
    (lambda d: d["handle"].update(lease_id="xyz"), "image_layouts[0].handle.lease_id", "must be hex"),
    (lambda d: d["handle"].update(offset="8"), "image_layouts[0].handle.offset", "malformed transfer handle"),
    (lambda d: d["handle"].update(offset=-8), "image_layouts[0].handle.offset", "must be >= 0"),
    (lambda d: d["handle"].update(agent_metadata="not base64!"), "image_layouts[0].handle.agent_metadata",
     "malformed transfer handle"),
    (lambda d: d["handle"].update(shm_path=""), "image_layouts[0].handle.shm_path", "must not be empty"),
    (lambda d: d["handle"].update(transport="rdma"), "image_layouts[0].handle.transport", "unknown transport 'rdma'"),
    (lambda d: d["handle"].pop("transport"), "image_layouts[0].handle.transport", "unknown transport None"),
    (lambda d: d["handle"].update(transport="cuda_ipc"), "image_layouts[0].handle.ipc_handle", "no ipc_handle"),
    (lambda d: d.update(handle=[]), "image_layouts[0].handle", "malformed transfer handle"),
    (lambda d: d.pop("content_key"), "image_layouts[0]", "malformed layout"),
])
def test_consumer_refuses_what_it_does_not_understand(mutate, field, fragment):
    doc = json.loads(layout().to_json())
    mutate(doc)
    with pytest.raises(InvalidInput) as info:
        LayoutMetadata.from_json(json.dumps(doc), "image_layouts[0]", expected_model="qwen2_vl:abc")
    assert info.value.field == field and fragment in str(info.value)


@pytest.mark.parametrize("mutate, field, fragment", [
    (lambda d: d.update(ipc_handle="ab" * 63), "image_layouts[0].handle.ipc_handle", "64 bytes as hex"),
    (lambda d: d.update(ipc_handle="zz" * 64), "image_layouts[0].handle.ipc_handle", "64 bytes as hex"),
    (lambda d: d.update(tag_slot=-1), "image_layouts[0].handle.tag_slot", "must be >= 0"),
    (lambda d: d.pop("pool_bytes"), "image_layouts[0].handle.pool_bytes", "no pool_bytes"),
])
def test_a_cuda_ipc_handle_is_checked_too(mutate, field, fragment):
    doc = json.loads(layout("cuda_ipc").to_json())
    mutate(doc["handle"])
    with pytest.raises(InvalidInput) as info:
        LayoutMetadata.from_json(json.dumps(doc), "image_layouts[0]")
    assert info.value.field == field and fragment in str(info.value)


def test_a_version_1_document_is_refused_by_its_version():
    old = {"version": 1, "content_key": "k1", "modality": "image", "model": "qwen2_vl:abc", "dtype": "float32",
           "shape": [4, 128], "image_grid_thw": [1, 4, 4],
           "handle": {"agent_name": "enc-1", "agent_metadata": "", "descriptors": "", "lease_id": "00ab",
                      "nbytes": 2048, "expires_at": time.time() + 30}}
    with pytest.raises(InvalidInput, match=r"version 1 \(older") as info:
        LayoutMetadata.from_json(json.dumps(old), "image_layouts[2]", expected_model="qwen2_vl:abc")
    assert info.value.field == "image_layouts[2].version"


def test_not_json():
    with pytest.raises(InvalidInput, match="not valid JSON"):
        LayoutMetadata.from_json("{", "image_layouts[0]")


@pytest.mark.parametrize("member, value", [("content_key", 7), ("model", None), ("dtype", ["float32"]),
                                           ("shape", [4, 1.5]), ("shape", "4x128")])
def test_a_common_member_of_the_wrong_type_is_named(member, value):
    doc = json.loads(layout().to_json())
    doc[member] = value
    with pytest.raises(InvalidInput) as info:
        LayoutMetadata.from_json(json.dumps(doc), "image_layouts[1]")
    assert info.value.field == f"image_layouts[1].{member}"


def test_placeholder_embeddings_of_a_kv_consumer_have_the_pulled_shape_and_dtype():
    """A KV consumer on a vLLM that needs the tensor (0.26) gets zeros per modality, shaped as ``pull_media_embeds``
    would give them."""
    import torch

    from backend.protocol.layout import VideoLayout
    from backend.transfer.engine_inputs import media_grids, placeholder_media_embeds

    layouts = [layout(dtype="bfloat16"), layout(dtype="bfloat16", shape=(8, 128), media=VideoLayout((2, 4, 4))),
               layout(dtype="bfloat16", shape=(16, 128), media=ImageLayout((1, 8, 8)))]
    zeros = placeholder_media_embeds(layouts)
    assert {name: (tuple(t.shape), t.dtype) for name, t in zeros.items()} == {
        "image": ((20, 128), torch.bfloat16), "video": ((8, 128), torch.bfloat16)}
    assert not any(t.any() for t in zeros.values())
    assert media_grids(layouts)["image"].tolist() == [[1, 4, 4], [1, 8, 8]]


def test_the_topology_host_name_is_part_of_the_host_identity(monkeypatch):
    from backend.protocol.handles import host_identity

    monkeypatch.delenv("EPD_HOST", raising=False)
    plain = host_identity()
    monkeypatch.setenv("EPD_HOST", "enc-a")
    a = host_identity()
    monkeypatch.setenv("EPD_HOST", "enc-b")
    assert len({plain, a, host_identity()}) == 3 and a.startswith(plain)
