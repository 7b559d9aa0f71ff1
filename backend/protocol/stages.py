"""The stage roles, declared once: what each stage of a deployment takes and does (``Stage``, ``RoleSpec``),
and the two ways a multimodal request is split across them (``Disaggregation``).

A role's spec is what its Triton model, the orchestrator that asks it and the topology renderer all read:

- ``takes_media``: the client's media (``image`` bytes, URLs), decoded where the role needs them;
- ``takes_layouts``: metadata-only media (``image_layouts``: each item's layout and embedding handle);
- ``pulls_embeddings``: fetches each item's embeddings by handle before submitting (decode does not: the KV it
  receives already covers the media positions);
- ``kv_role``: vLLM's NixlConnector role (``kv_producer`` prefill, ``kv_consumer`` decode), None without KV transfer;
- ``generates``: hosts a vLLM engine that produces tokens;
- ``idle_wait_ms``: the EngineCore's default idle wait after a step that ran no model
  (``backend.engine.patches.patch_idle_wait``; None: vLLM's own 1 ms sleep; model parameter ``engine_idle_wait_ms``).

The values are the names the deployment uses: a topology's stage keys (``stages.pd``) and its model names.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class RoleSpec:
    takes_media: bool
    takes_layouts: bool
    pulls_embeddings: bool
    kv_role: str | None
    generates: bool
    idle_wait_ms: float | None = None


class Stage(enum.Enum):
    ENCODER = "encoder"  # decodes, preprocesses and encodes media items; publishes their embeddings
    LLM = "llm"  # the single-engine baseline, given the raw media
    PD = "pd"  # prefill + decode in one engine, fed metadata-only media (E+PD)
    PREFILL = "prefill"  # E/P/D: prefills (one token) and hands its KV to decode
    DECODE = "decode"  # E/P/D: pulls prefill's KV and generates
    ORCHESTRATOR = "epd"  # encodes every item, rewrites the request to metadata-only, relays the generator's stream

    @property
    def spec(self) -> RoleSpec:
        return _SPECS[self]


_SPECS = {
    Stage.ENCODER: RoleSpec(takes_media=True, takes_layouts=False, pulls_embeddings=False, kv_role=None, generates=False),
    Stage.LLM: RoleSpec(takes_media=True, takes_layouts=False, pulls_embeddings=False, kv_role=None, generates=True),
    Stage.PD: RoleSpec(takes_media=False, takes_layouts=True, pulls_embeddings=True, kv_role=None, generates=True),
    # P/D (an orchestrator that skips the encoders) sends prefill and decode the client's media.
    # Prefill's finished requests keep the EngineCore stepping (a model-less step every ~1 ms) until decode has read
    # their KV; new requests and aborts still wake it at once, so a longer idle wait delays only freeing those blocks.
    Stage.PREFILL: RoleSpec(takes_media=True, takes_layouts=True, pulls_embeddings=True, kv_role="kv_producer",
                            generates=True, idle_wait_ms=10),
    Stage.DECODE: RoleSpec(takes_media=True, takes_layouts=True, pulls_embeddings=False, kv_role="kv_consumer",
                           generates=True),
    Stage.ORCHESTRATOR: RoleSpec(takes_media=True, takes_layouts=False, pulls_embeddings=False, kv_role=None,
                                 generates=False),
}


class Disaggregation(enum.Enum):
    """How a deployment splits a request: E+PD (encoders, then one engine) or E/P/D (encoders, prefill, decode)."""

    E_PD = "E+PD"
    E_P_D = "E/P/D"

    @property
    def generators(self) -> tuple[Stage, ...]:
        """The generator stages the orchestrator asks, in order; the last one streams to the client."""
        return (Stage.PD,) if self is Disaggregation.E_PD else (Stage.PREFILL, Stage.DECODE)

    @property
    def streamer(self) -> Stage:
        """The stage whose output stream goes back to the client."""
        return self.generators[-1]

    @property
    def host(self) -> Stage:
        """The stage whose instances can host this deployment's orchestrator (colocated beside its engine)."""
        return self.generators[0]

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage a deployment of this kind runs."""
        return (Stage.ENCODER, *self.generators, Stage.ORCHESTRATOR)

    @property
    def generators_take_media(self) -> bool:
        """Whether every generator stage also takes the client's media (so a request may skip the encoders: P/D)."""
        return all(stage.spec.takes_media for stage in self.generators)


__all__ = ["Disaggregation", "RoleSpec", "Stage"]
