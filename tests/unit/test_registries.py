"""The two extension points as registries: model families by ``model_type`` (``backend.encode.families``) and
transports by their handle's ``transport`` name (``backend.transfer.transports``): lookups, the errors for an unknown
name, every shipped family and transport present, and what the registries give the encoder, the producer and the
consumer."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from backend.encode import families
from backend.encode.checkpoint import embedding_width, embedding_widths
from backend.encode.families import Family, UnknownFamily, VisionTower, family_for
from backend.protocol.handles import TRANSPORTS as HANDLES
from backend.protocol.handles import CudaIpcHandle, NixlHandle, SharedMemoryHandle
from backend.transfer import transports
from backend.transfer.same_host import SharedMemoryReader
from backend.transfer.transports import Transport, UnknownTransport, handle_for, transport

COMMON = dict(agent_name="a", agent_metadata=b"m", descriptors=b"", lease_id="ab", nbytes=8, expires_at=1.0)


def test_every_shipped_family_is_registered_with_its_towers():
    assert families.known() == ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni")
    assert {t: family_for(t).modalities for t in families.known()} == {
        "qwen2_vl": ("image", "video"), "qwen2_5_vl": ("image", "video"), "qwen3_vl": ("image", "video"),
        "qwen2_audio": ("audio",), "qwen2_5_omni": ("image", "video", "audio")}
    assert [t for t in families.known() if family_for(t).vision and family_for(t).vision.packed] == [
        "qwen2_vl", "qwen2_5_vl"]  # the families backend.encode.packed_tower implements
    assert all(family_for(t).tiny_recipe == t for t in families.known())


def test_an_unknown_model_type_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(UnknownFamily, match=r"'llava'.*qwen2_5_omni, qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_vl"):
        family_for("llava")


def test_a_family_registers_once_and_can_be_looked_up_and_removed():
    family = Family("fake_vl", vision=VisionTower(lambda: object))
    assert families.register(family) is family
    try:
        assert family_for("fake_vl") is family and family.modalities == ("image", "video")
        with pytest.raises(ValueError, match="already registered"):
            families.register(Family("fake_vl"))
    finally:
        families.unregister("fake_vl")
    with pytest.raises(UnknownFamily):
        family_for("fake_vl")


def test_the_tower_classes_are_the_families_transformers_classes():
    names = {t: family_for(t).vision.load_class().__name__ for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}
    assert names == {"qwen2_vl": "Qwen2VisionTransformerPretrainedModel",
                     "qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel", "qwen3_vl": "Qwen3VLVisionModel"}
    assert family_for("qwen2_audio").audio.load_class().__name__ == "Qwen2AudioEncoder"


def _config(tmp_path, doc):
    (tmp_path / "config.json").write_text(json.dumps(doc))
    return tmp_path


def test_embedding_widths_follow_each_family_s_rule(tmp_path):
    vision = {"hidden_size": 1536, "deepstack_visual_indexes": [0, 1]}
    text = {"hidden_size": 128}
    assert embedding_widths(_config(tmp_path, {"model_type": "qwen2_vl", "vision_config": vision,
                                               "text_config": text})) == {"image": 4608, "video": 4608}
    # the vision hidden size is Qwen2-VL's merger output only; other families fall back to the text width
    assert embedding_width(_config(tmp_path, {"model_type": "qwen2_5_vl", "vision_config": {"hidden_size": 1536},
                                              "text_config": text})) == 128
    assert embedding_widths(_config(tmp_path, {"model_type": "qwen2_audio", "text_config": text})) == {"audio": 128}
    with pytest.raises(UnknownFamily, match="'other'"):
        embedding_width(_config(tmp_path, {"model_type": "other"}))


def test_a_family_with_a_width_per_modality_fits_and_the_single_width_refuses_it(tmp_path):
    class Omni(Family):
        def embedding_widths(self, config):
            return {"image": 64, "video": 64, "audio": 32}

    families.register(Omni("fake_omni", vision=VisionTower(lambda: object),
                           audio=families.AudioTower(lambda: object)))
    try:
        path = _config(tmp_path, {"model_type": "fake_omni"})
        assert family_for("fake_omni").modalities == ("image", "video", "audio")
        assert embedding_widths(path) == {"image": 64, "video": 64, "audio": 32}
        with pytest.raises(ValueError, match="differ in width per modality"):
            embedding_width(path)
    finally:
        families.unregister("fake_omni")


def test_every_handle_transport_has_a_registered_transport_in_the_producer_s_order():
    assert [t.name for t in transports.transports()] == ["cuda_ipc", "shared_memory", "nixl"]
    assert {t.name: t.handle_class for t in transports.transports()} == HANDLES
    assert transport("shared_memory").reader is not None and transport("nixl").reader is None


def test_an_unknown_transport_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(UnknownTransport, match=r"'rdma'.*cuda_ipc, shared_memory, nixl"):
        transport("rdma")


def test_a_transport_must_carry_its_own_handle_and_registers_once():
    with pytest.raises(ValueError, match="has the handle of 'nixl'"):
        Transport("other", NixlHandle, lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        transports.register(transport("nixl"))


@pytest.mark.parametrize("pool, expected", [
    (dict(ipc_handle="0" * 128, shm_path="", tag_table="/t"), CudaIpcHandle),
    (dict(ipc_handle="", shm_path="/proc/1/fd/3", tag_table=""), SharedMemoryHandle),
    (dict(ipc_handle="", shm_path="", tag_table=""), NixlHandle),
])
def test_the_producer_takes_the_first_transport_that_offers_its_pool(pool, expected):
    pool = SimpleNamespace(buffer=torch.zeros(64, dtype=torch.uint8), **pool)
    handle = handle_for(pool, COMMON, offset=16, tag_slot=2)
    assert type(handle) is expected and handle.agent_name == "a"
    if expected is CudaIpcHandle:
        assert (handle.pool_bytes, handle.offset, handle.tag_slot, handle.tag_table) == (64, 16, 2, "/t")
    if expected is SharedMemoryHandle:
        assert (handle.shm_path, handle.offset) == ("/proc/1/fd/3", 16)


def test_the_shared_memory_reader_leaves_an_unmappable_pool_to_nixl():
    reader = transport("shared_memory").reader(torch.device("cpu"), SharedMemoryReader())
    layout = SimpleNamespace(handle=SharedMemoryHandle(**COMMON, shm_path=""))
    assert reader.read(layout, "a", 0) is None  # no memfd to map: the consumer READs through NIXL
