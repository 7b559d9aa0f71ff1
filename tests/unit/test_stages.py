"""The stage roles (backend.protocol.stages): one vocabulary, read by the models, the orchestrator and the renderer."""
from __future__ import annotations

from pathlib import Path

from backend.deploy.schema import DEPLOYMENTS, ENGINE_STAGES, GPU_STAGES, HOSTS, ModelKind, REMOTE_STAGES

from backend.deploy.topology import load
from backend.protocol.stages import Disaggregation, Stage

ROOT = Path(__file__).resolve().parents[2]


def test_the_roles_specs():
    assert [s.value for s in Stage] == ["encoder", "llm", "pd", "prefill", "decode", "epd"]
    assert {s for s in Stage if s.spec.pulls_embeddings} == {Stage.PD, Stage.PREFILL}
    assert {s: s.spec.kv_role for s in Stage if s.spec.kv_role} == {Stage.PREFILL: "kv_producer",
                                                                    Stage.DECODE: "kv_consumer"}
    assert {s for s in Stage if s.spec.takes_layouts} == {Stage.PD, Stage.PREFILL, Stage.DECODE}
    assert not Stage.PD.spec.takes_media and Stage.PREFILL.spec.takes_media and Stage.DECODE.spec.takes_media
    assert {s for s in Stage if s.spec.generates} == {Stage.LLM, Stage.PD, Stage.PREFILL, Stage.DECODE}
    assert Stage.PREFILL.spec.idle_wait_ms == 10 and Stage.DECODE.spec.idle_wait_ms is None


def test_the_two_splits():
    assert Disaggregation("E+PD") is Disaggregation.E_PD and Disaggregation("E/P/D") is Disaggregation.E_P_D
    assert Disaggregation.E_PD.generators == (Stage.PD,) and Disaggregation.E_PD.streamer is Stage.PD
    assert Disaggregation.E_P_D.generators == (Stage.PREFILL, Stage.DECODE) and Disaggregation.E_P_D.streamer is Stage.DECODE
    assert Disaggregation.E_PD.host is Stage.PD and Disaggregation.E_P_D.host is Stage.PREFILL
    assert not Disaggregation.E_PD.generators_take_media and Disaggregation.E_P_D.generators_take_media


def test_the_deployment_tables_are_the_roles():
    assert DEPLOYMENTS == {"baseline": ("llm",), "E+PD": ("encoder", "pd", "epd"),
                           "E/P/D": ("encoder", "prefill", "decode", "epd")}
    assert ENGINE_STAGES == ("llm", "pd", "prefill", "decode") and GPU_STAGES == ("encoder", *ENGINE_STAGES)
    assert REMOTE_STAGES == ("pd", "prefill", "decode") and HOSTS == {"E+PD": "pd", "E/P/D": "prefill"}


def test_model_kinds_say_what_they_are():
    assert ModelKind.COLOCATED_PREFILL == "epd:E/P/D:colocated" and str(ModelKind.EPD) == "epd:E+PD"
    assert ModelKind.COLOCATED_PREFILL.disaggregation is Disaggregation.E_P_D and ModelKind.COLOCATED_PREFILL.engine is Stage.PREFILL
    assert ModelKind.COLOCATED.colocated and not ModelKind.EPD.colocated and not ModelKind.PD.colocated
    assert [k.stage for k in (ModelKind.EPD, ModelKind.COLOCATED, ModelKind.ENCODER)] == ["epd", "pd", "encoder"]
    assert ModelKind.orchestrator(Disaggregation.E_P_D, colocated=False) is ModelKind.EPD_DISAGG
    models = load(ROOT / "topologies" / "default.yaml", "cpu").models()
    assert all(isinstance(kind, ModelKind) for kind in models.values()) and models["pd"] is ModelKind.PD
