"""A deployment topology's schema (``backend.deploy.topology`` reads a YAML file into it, ``backend.deploy.render``
and ``backend.deploy.hosts`` build on it): the ``Topology`` and its ``StageSpec``s, the keys and defaults a file may
give, and the one error a bad file raises (``TopologyError``, naming the key)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend.protocol.settings import (ColocatedSettings, EncoderSettings, EngineSettings, HeldSettings, KvEngineSettings,
                                       LlmSettings, MediaSettings, PdSettings, PrefillSettings, ProxySettings,
                                       RoutingSettings, defaults)
from backend.protocol.stages import Disaggregation, Stage

ROOT = Path(__file__).resolve().parents[2]
# deployment -> the stages it runs (topology keys: the roles' names, backend.protocol.stages)
DEPLOYMENTS = {"baseline": (Stage.LLM.value,), **{d.value: tuple(s.value for s in d.stages) for d in Disaggregation}}
ENGINE_STAGES = tuple(stage.value for stage in Stage if stage.spec.generates)
GPU_STAGES = (Stage.ENCODER.value, *ENGINE_STAGES)
MAX_INSTANCES = 16
TOP_KEYS = {"name", "checkpoint", "serve", "stages", "engine_args", "transfer", "limits", "stream_interval_ms", "openai_port",
            "engine_nice", "video_split", "tier", "reuse", "hosts", "admission"}
STAGE_KEYS = {"instances", "device", "gpus", "orchestrator", "endpoint", "video_decoder", "image_preprocess",
              "cuda_graphs"}
# reached by an orchestrator over gRPC: they take an endpoint
REMOTE_STAGES = tuple(stage.value for d in Disaggregation for stage in d.generators)
ENDPOINT_STAGES = (Stage.ENCODER.value, *REMOTE_STAGES)  # stages.<stage>.endpoint: where the orchestrators reach them
ORCHESTRATORS = ("proxy", "colocated")  # stages.<host>.orchestrator: where a deployment's orchestrator runs
# stages.decode.orchestrator: colocated: decode's engine runs in E/P/D's orchestrator too (prefill's instances)
IN_PROCESS_DECODE = Stage.DECODE.value
HOSTS = {d.value: d.host.value for d in Disaggregation}  # deployment -> the stage that can host its orchestrator
# the models' settings (backend.protocol.settings) these sections render; their defaults are the models'
TRANSFER_DEFAULTS = {**defaults(EncoderSettings, "pool_bytes", "lease_seconds", "alloc_timeout_seconds"),
                     **defaults(KvEngineSettings, "nixl_poll_delay_us", "kv_lease_seconds")}
LIMIT_DEFAULTS = {**defaults(ProxySettings, "max_images", "max_videos", "max_audios"),
                  **defaults(MediaSettings, "max_image_pixels", "max_item_bytes", "max_video_frames", "max_video_seconds",
                             "max_audio_seconds"),
                  **defaults(ProxySettings, "request_timeout_seconds")}  # the last: epd's deadline per request
# tier: {bytes: N, ...}: the shared embedding tier (EncoderSettings.tier_*; docs/tier.md); no block: no tier
TIER_DEFAULTS = {"bytes": 0, **{k.removeprefix("tier_"): v for k, v in defaults(
    EncoderSettings, "tier_master", "tier_metadata", "tier_call_timeout_seconds", "tier_retry_seconds",
    "tier_claim_seconds").items()}}
# reuse: {held_bytes, session_seconds, session_bytes, session_kv_bytes, demand_aware}: the consumers' copies of what
# they pulled (HeldSettings; backend.transfer.held), their engines' KV of conversations (backend.engine.session_kv) and
# demand-aware encoding at the orchestrators (docs/tier.md); no block: off
REUSE_DEFAULTS = {**defaults(HeldSettings, "held_bytes", "session_seconds", "session_bytes", "session_kv_bytes"),
                  **defaults(RoutingSettings, "demand_aware")}
# admission: {priority_levels, <stage>_in_flight budgets, max_queue_ms, first_token_target_ms}: the orchestrators'
# admission by budget and the priority classes every model takes (AdmissionBudgets, PrioritySettings;
# orchestrator.admission); no block: no budgets
# the admission settings the orchestrators take as model parameters (RoutingSettings' fields of those names)
ADMISSION_PARAMETERS = ("priority_levels", "encoder_items_in_flight", "encoder_bytes_in_flight",
                        "generator_requests_in_flight", "decode_requests_in_flight", "max_queue_ms",
                        "high_priority_reserve_percent", "high_priority_burst_percent", "first_token_target_ms")
ADMISSION_DEFAULTS = {**defaults(RoutingSettings, *ADMISSION_PARAMETERS),
                      # the encoder's Triton queue: one per priority class (priority) or one (fifo: the orchestrators'
                      # gates still let encodes in by priority; render._encoder_batching says why it is a choice)
                      "encoder_queue": "priority"}
ENCODER_QUEUES = ("priority", "fifo")
# engines schedule by priority (vLLM's scheduling_policy): a request's priority reaches them (equal ones: first come)
ENGINE_DEFAULTS = {"scheduling_policy": "priority", "dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 32,
                   "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni", "seed": 0,
                   "disable_log_stats": True}


class TopologyError(ValueError):
    pass


class ModelKind(enum.StrEnum):
    """What a rendered model is: its ``role`` (``backend.protocol.stages.Stage``), for an orchestrator the
    ``disaggregation`` it orchestrates, and ``engine``: the stage whose vLLM engine, instances and device it has
    (None: none; an orchestrator with an engine is colocated with that stage). Its value is the kind's name
    (``epd:E+PD:colocated``)."""

    def __new__(cls, value: str, role: Stage, disaggregation: Disaggregation | None = None,
                engine: Stage | None = None):
        kind = str.__new__(cls, value)
        kind._value_ = value
        kind.role, kind.disaggregation, kind.engine = role, disaggregation, engine
        return kind

    LLM = "llm", Stage.LLM, None, Stage.LLM
    ENCODER = "encoder", Stage.ENCODER
    PD = "pd", Stage.PD, None, Stage.PD
    PREFILL = "prefill", Stage.PREFILL, None, Stage.PREFILL
    DECODE = "decode", Stage.DECODE, None, Stage.DECODE
    EPD = "epd:E+PD", Stage.ORCHESTRATOR, Disaggregation.E_PD
    EPD_DISAGG = "epd:E/P/D", Stage.ORCHESTRATOR, Disaggregation.E_P_D
    COLOCATED = "epd:E+PD:colocated", Stage.ORCHESTRATOR, Disaggregation.E_PD, Stage.PD
    COLOCATED_PREFILL = "epd:E/P/D:colocated", Stage.ORCHESTRATOR, Disaggregation.E_P_D, Stage.PREFILL

    @classmethod
    def orchestrator(cls, disaggregation: Disaggregation, colocated: bool) -> "ModelKind":
        return next(kind for kind in cls if kind.role is Stage.ORCHESTRATOR and kind.disaggregation is disaggregation
                    and (kind.engine is not None) == colocated)

    @property
    def colocated(self) -> bool:
        return self.role is Stage.ORCHESTRATOR and self.engine is not None

    @property
    def stage(self) -> str:
        """The topology stage whose instances and device the model has."""
        return (self.engine or self.role).value

    @property
    def settings(self) -> type:
        """The settings class (``backend.protocol.settings``) the model reads its rendered parameters into."""
        if self.role is Stage.ORCHESTRATOR:
            return ColocatedSettings if self.colocated else ProxySettings
        return {Stage.ENCODER: EncoderSettings, Stage.PREFILL: PrefillSettings, Stage.PD: PdSettings,
                Stage.DECODE: KvEngineSettings, Stage.LLM: LlmSettings}.get(self.role, EngineSettings)


@dataclass(frozen=True)
class StageSpec:
    instances: int = 1
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    # pd / prefill (HOSTS): "colocated" runs the deployment's orchestrator in its instances; decode: "colocated" runs
    # decode's engine in those too (E/P/D's orchestrator colocated with prefill)
    orchestrator: str = "proxy"
    endpoint: str = "local"  # ENDPOINT_STAGES: where the orchestrators reach it (backend.deploy.server_address)
    video_decoder: str = "cpu"  # encoder: where its videos are decoded (EncoderSettings.video_decoder; nvdec: gpu only)
    image_preprocess: str = "cpu"  # encoder: where its images are preprocessed (EncoderSettings.image_preprocess)
    cuda_graphs: bool = False  # encoder: its tower compiled and replayed as CUDA graphs (EncoderSettings.encoder_cuda_graphs)


@dataclass(frozen=True)
class Topology:
    name: str
    checkpoint: Path
    serve: tuple[str, ...]
    stages: dict[str, StageSpec]
    engine_args: dict[str, Any] = field(default_factory=dict)
    transfer: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    stream_interval_ms: float = 0.0  # streaming engines send at most one response per interval (0: every step)
    # the OpenAI-compatible endpoint served from the served deployment's own model process on this port (0: none;
    # frontend.openai.in_process); one served deployment only
    openai_port: int = 0
    # the engines' EngineCore processes run at this Linux niceness (0: as the server): under CPU contention the request
    # path (tritonserver, the orchestrators, the endpoint, the encoders) runs before their steps (EngineSettings)
    engine_nice: int = 0
    video_split: int = 1  # the orchestrators encode each video in this many parts at once (RoutingSettings.video_split)
    tier: dict[str, Any] = field(default_factory=dict)  # the shared embedding tier (TIER_DEFAULTS' keys); {}: none
    reuse: dict[str, Any] = field(default_factory=dict)  # consumers' copies, demand-aware (REUSE_DEFAULTS' keys); {}: off
    admission: dict[str, Any] = field(default_factory=dict)  # ADMISSION_DEFAULTS' keys given in the file; {}: defaults
    hosts: dict[str, Any] = field(default_factory=dict)  # host name -> backend.deploy.hosts.HostSpec; {}: one server
    source: str = ""  # the YAML file it was loaded from (relative to the project root when inside it)

    def only(self, deployment: str | tuple[str, ...], engine_args: dict[str, Any] | None = None, **changes) -> "Topology":
        """This topology serving ``deployment`` (one, or several side by side) alone (their stages only; its hosts
        keep those, a host left with none is dropped), with ``engine_args`` laid over its own and other fields replaced
        by ``changes``."""
        deployments = (deployment,) if isinstance(deployment, str) else tuple(deployment)
        if len(deployments) > 1 and changes.get("openai_port", self.openai_port):
            raise TopologyError(f"{self.name}: openai_port: the endpoint in a model's process serves that model alone, "
                                f"not {' + '.join(deployments)}")
        unknown = [m for m in deployments if m not in DEPLOYMENTS]
        if unknown or not deployments:
            raise TopologyError(f"unknown deployment {', '.join(map(repr, unknown))}; known: {', '.join(DEPLOYMENTS)}")
        colocated = self.colocated
        stages = [stage for m in deployments for stage in deployment_stages(m, colocated)]
        missing = sorted({stage for stage in stages if stage not in self.stages})
        if missing:
            raise TopologyError(f"{self.name}: cannot serve {' + '.join(deployments)} alone, "
                                f"no settings for {', '.join(missing)}")
        kept = {name: replace(host, stages=tuple(s for s in host.stages if s in stages))
                for name, host in self.hosts.items()}
        return replace(self, name=f"{self.name}-{'-'.join(deployments)}", serve=deployments,
                       checkpoint=self.checkpoint.resolve(),
                       stages={s: self.stages[s] for s in stages}, hosts={n: h for n, h in kept.items() if h.stages},
                       engine_args={**self.engine_args, **(engine_args or {})}, **changes)

    @property
    def colocated(self) -> tuple[str, ...]:
        """The served deployments whose orchestrator runs inside their host stage's instances
        (``stages.pd.orchestrator`` / ``stages.prefill.orchestrator: colocated``)."""
        return tuple(served for served in self.serve if served in HOSTS and HOSTS[served] in self.stages
                     and self.stages[HOSTS[served]].orchestrator == "colocated")

    @property
    def decode_in_process(self) -> bool:
        """Whether decode's engine runs in E/P/D's colocated orchestrator (``stages.decode.orchestrator:
        colocated``, with ``stages.prefill.orchestrator: colocated``): no model named ``decode`` then."""
        return (Disaggregation.E_P_D.value in self.colocated and IN_PROCESS_DECODE in self.stages
                and self.stages[IN_PROCESS_DECODE].orchestrator == "colocated")

    def with_decode_in_process(self) -> "Topology":
        """This topology with decode's engine in E/P/D's orchestrator (which must be colocated with prefill): decode's
        instances and device become prefill's, whose instances it runs in."""
        if Disaggregation.E_P_D.value not in self.colocated:
            raise TopologyError(f"{self.name}: decode in process: E/P/D's orchestrator must be colocated with prefill")
        if self.hosts:
            raise TopologyError(f"{self.name}: decode in process: its hosts block places the stages; edit the file")
        prefill = self.stages[Stage.PREFILL.value]
        return replace(self, stages={**self.stages, IN_PROCESS_DECODE: replace(prefill, orchestrator="colocated")})

    def with_orchestrator(self, where: str, deployment: str = "E+PD") -> "Topology":
        """This topology with ``deployment``'s orchestrator ``proxy`` or ``colocated``: the settings of the stages the
        deployments then use (an ``epd`` stage nothing uses is dropped; a proxy orchestrator without one gets the
        defaults, as in a file)."""
        if self.hosts:
            raise TopologyError(f"{self.name}: orchestrator {where}: its hosts block places the stages; edit the file")
        if where not in ORCHESTRATORS:
            raise TopologyError(f"{self.name}: orchestrator: expected one of {', '.join(ORCHESTRATORS)}, got {where!r}")
        if deployment not in HOSTS or deployment not in self.serve:
            raise TopologyError(f"{self.name}: orchestrator {where}: {deployment} has no orchestrator to place here "
                                f"(served: {', '.join(self.serve)}; orchestrators: {', '.join(HOSTS)})")
        host = HOSTS[deployment]
        stages = {"epd": StageSpec(), **self.stages, host: replace(self.stages[host], orchestrator=where)}
        colocated = tuple(m for m in HOSTS if stages.get(HOSTS[m], StageSpec()).orchestrator == "colocated")
        needed = {stage for m in self.serve for stage in deployment_stages(m, colocated)}
        return replace(self, stages={s: spec for s, spec in stages.items() if s in needed})

    def models(self) -> dict[str, ModelKind]:
        """Model name -> kind (``ModelKind``; a colocated kind is a deployment's orchestrator with its host stage's
        engine, in place of that stage's model)."""
        out: dict[str, ModelKind] = {}
        colocated = self.colocated
        for deployment in self.serve:
            for stage in DEPLOYMENTS[deployment]:
                if stage == Stage.ORCHESTRATOR.value:
                    name = "epd" if "epd" not in out else "epd_disagg"
                    out[name] = ModelKind.orchestrator(Disaggregation(deployment), deployment in colocated)
                elif not (deployment in colocated and stage == HOSTS[deployment]
                          or stage == IN_PROCESS_DECODE and self.decode_in_process):
                    out[stage] = ModelKind(stage)
        return out


def deployment_stages(deployment: str, colocated: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The stages whose settings ``deployment`` uses: a deployment in ``colocated`` has no ``epd`` stage of its own
    (its orchestrator runs in the instances of its host stage, ``HOSTS``)."""
    if deployment in colocated:
        return tuple(stage for stage in DEPLOYMENTS[deployment] if stage != "epd")
    return DEPLOYMENTS[deployment]


def check_keys(doc: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
