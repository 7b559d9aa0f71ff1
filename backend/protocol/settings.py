"""Each model's ``config.pbtxt`` parameters, declared once: one frozen dataclass per model kind, its fields typed and
their defaults written here only (the topology renderer, ``backend.deploy``, takes its defaults from these too).

``parse_settings`` reads a model config's ``parameters`` once and converts each value by its field's type, one way:
``bool`` is ``true`` or ``false``; ``int`` / ``float`` as Python parses them; ``X | None`` is None when empty;
``tuple[str, ...]`` is comma-separated (blanks dropped); an enum by its value. An unknown (misspelled) parameter or
a value of the wrong type is a ``ConfigError`` naming the model and the parameter, so the model fails to load
instead of running with a default nobody asked for. A parameter is named as its field, except where the field's
``PARAMETER`` metadata keeps an older wire name (``disaggregation`` is written ``topology`` in config.pbtxt).

Which kind reads which class: ``llm``: ``LlmSettings``; ``pd``: ``PdSettings``; ``prefill``, ``decode``: ``KvEngineSettings``;
``encoder``: ``EncoderSettings``; the ``epd`` proxy orchestrator: ``ProxySettings``; an orchestrator colocated with
its host stage's engine: ``ColocatedSettings``.
"""
from __future__ import annotations

import enum
import typing
from dataclasses import dataclass, field, fields

from backend.protocol.stages import Disaggregation, Stage

LOCAL = "local"  # a stage endpoint: the server the orchestrator runs in (backend.deploy.server_address.LOCAL)
PARAMETER = "parameter"  # a field's metadata key: its config.pbtxt parameter's name, where that is not the field's


class ConfigError(ValueError):
    """A model's config.pbtxt parameters that cannot be used: raised at load, naming the model and parameter."""


@dataclass(frozen=True)
class MediaSettings:
    """What every model that decodes, or checks, media reads."""

    max_image_pixels: int = 16_000_000  # an image's, and each video frame's
    max_item_bytes: int = 32 << 20
    max_video_frames: int = 18_000  # the frames a video's container may hold
    max_video_seconds: float = 600.0  # and its length
    max_audio_seconds: float = 600.0  # an audio file's length (vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S default)


@dataclass(frozen=True)
class PrioritySettings:
    """Every model that takes generate requests: a request's ``priority`` is 0 .. ``priority_levels`` - 1 (0 first)."""

    priority_levels: int = 4


@dataclass(frozen=True)
class EngineSettings(PrioritySettings, MediaSettings):
    """A model hosting a vLLM engine (``llm``, ``pd``)."""

    engine_args: str = "model.json"  # the engine arguments' file, in the model's directory
    stream_interval_ms: float = 0  # at most one streamed response per interval (0: every engine step)
    engine_nice: int = 0  # the EngineCore's Linux niceness, 0-19 (backend.engine.patches.lower_priority; 0: as the stub)


@dataclass(frozen=True)
class OpenAISettings:
    """A served model (``llm``, the orchestrators) that may serve the OpenAI-compatible endpoint from its own process
    (``frontend.openai.in_process``; topology ``openai_port``)."""

    openai_port: int = 0  # 0: none here (the separate endpoint, python -m frontend.openai, may front the server)
    openai_host: str = "127.0.0.1"


@dataclass(frozen=True)
class LlmSettings(OpenAISettings, EngineSettings):
    """``llm``: the single engine, given the client's media."""


@dataclass(frozen=True)
class KvEngineSettings(EngineSettings):
    """A vLLM engine with NixlConnector (``prefill``, ``decode``)."""

    nixl_side_channel_port: int | None = None  # None: a free port
    nixl_poll_delay_us: int = 5000  # how long NIXL agents sleep between polls (backend.engine.patches)
    # how long a producer (prefill) keeps a finished request's KV for a decode that has not read it yet, renewed by
    # the decode's heartbeats (every sixth of it) while it does: NixlConnector's kv_lease_duration (vLLM's default)
    kv_lease_seconds: int = 30
    engine_idle_wait_ms: float | None = None  # None: the role's (backend.protocol.stages.RoleSpec.idle_wait_ms)


@dataclass(frozen=True)
class HeldSettings:
    """A consumer's own copies of the embeddings it pulled (``pd``, ``prefill``; ``backend.transfer.held``)."""

    held_bytes: int = 0  # recently pulled items kept, least recently used evicted first (0: none kept)
    session_seconds: float = 0  # a conversation's (session_id) items are kept this long after its last turn (0: not)
    session_bytes: int = 0  # the budget of those; over it, the sessions idle longest lose their protection first
    # the engine's KV of conversations' prompts kept this long too, in a store of this size in the EngineCore's host
    # memory (backend.engine.session_kv; 0: not kept): a later turn prefills only what it adds
    session_kv_bytes: int = 0


@dataclass(frozen=True)
class PdSettings(HeldSettings, EngineSettings):
    """``pd``: prefill and decode on one engine, fed metadata-only media."""


@dataclass(frozen=True)
class PrefillSettings(HeldSettings, KvEngineSettings):
    """``prefill``: a KV producer fed metadata-only media (or media, for P/D)."""


class VideoDecoder(enum.StrEnum):
    """Where an encoder decodes videos (``backend.request.video``): the CPU, or NVDEC on its GPU (``KIND_GPU``)."""

    CPU = "cpu"
    NVDEC = "nvdec"


class ImagePreprocess(enum.StrEnum):
    """Where an encoder preprocesses images (``backend.encode.gpu_image``): the host (PIL and the processor there), its
    GPU (decoded on the host, resized, normalised and patchified on the GPU: the host's pixels bit for bit), or its GPU
    with JPEGs decoded by nvJPEG too (within a measured bound of the host's pixels). GPU ones need ``KIND_GPU``."""

    CPU = "cpu"
    GPU = "gpu"
    NVJPEG = "nvjpeg"


@dataclass(frozen=True)
class EncoderSettings(MediaSettings):
    model: str = ""  # the checkpoint, relative to the model repository
    encoder_impl: str = "packed"  # or "transformers"
    encoder_dtype: str = ""  # "": the checkpoint's
    encoder_compile: bool = False  # torch.compile the packed blocks (CUDA only)
    encoder_cuda_graphs: bool = False  # with encoder_compile: the packed forward as CUDA graphs (backend.encode.tower_graphs)
    video_decoder: VideoDecoder = VideoDecoder.CPU  # nvdec: frames equal the CPU's bit for bit (backend.request.nvdec)
    image_preprocess: ImagePreprocess = ImagePreprocess.CPU  # gpu / nvjpeg: backend.encode.gpu_image
    # a KIND_GPU instance's waits for its GPU sleep instead of spin (backend.encode.cuda_wait; measured on the H200
    # 2026-12-04: no change in the encoder's CPU per image, so not rendered by any topology)
    cuda_blocking_sync: bool = False
    pool_bytes: int = 64 << 20  # the NIXL-registered embedding pool
    lease_seconds: float = 30  # how long an unread embedding lease is kept
    alloc_timeout_seconds: float = 1.0  # how long an encode waits for pool space before OVERLOADED
    cache_bytes: int = 32 << 20  # embeddings of recent items kept for reuse (0: no cache)
    # the shared embedding tier every instance reads on a cache miss and writes after an encode (docs/tier.md)
    tier_bytes: int = 0  # its byte budget (0: no tier); the launcher starts a tier of this size for the server
    tier_master: str = ""  # its Mooncake master, host:port ("": the one the launcher started, EPD_TIER_MASTER)
    tier_metadata: str = ""  # its metadata server, http://host:port/metadata ("": the launcher's, EPD_TIER_METADATA)
    tier_call_timeout_seconds: float = 1.0  # a store call slower than this counts as the tier down
    tier_retry_seconds: float = 10.0  # how long a down tier is skipped before it is tried again
    tier_claim_seconds: float = 5.0  # how long an item another instance claimed is waited for before encoding it here


@dataclass(frozen=True)
class AdmissionBudgets:
    """An orchestrator's admission (``orchestrator.admission``): what may be in flight at each stage at once (0: no bound)
    and the longest a request waits for one (0: until its deadline)."""

    encoder_items_in_flight: int = 0
    encoder_bytes_in_flight: int = 0
    generator_requests_in_flight: int = 0  # pd (E+PD) or prefill (E/P/D)
    decode_requests_in_flight: int = 0
    max_queue_ms: float = 0
    high_priority_reserve_percent: float = 0  # of each budget, only for priority 0 (the others fill the rest)
    high_priority_burst_percent: float = 0  # over each budget, only for priority 0 (a burst of them goes in at once)
    # the generator gates' limit of requests in flight follows their first tokens toward this (0: the budgets are fixed;
    # orchestrator.admission)
    first_token_target_ms: float = 0


@dataclass(frozen=True)
class RoutingSettings(AdmissionBudgets, PrioritySettings):
    """What every orchestrator reads: the split, the stages it asks, the request's deadline, admission."""

    # the deployment's split; its config.pbtxt parameter is "topology", the name existing model repositories use
    disaggregation: Disaggregation = field(default=Disaggregation.E_PD, metadata={PARAMETER: "topology"})
    encoder_model: str = "encoder"
    encoder_endpoint: str = LOCAL
    decode_model: str = "decode"
    decode_endpoint: str = LOCAL
    request_timeout_seconds: float = 300  # per request, encode to last token (0: none)
    metadata_only: bool = True  # false: naive EPD, the consumers also get the client's media
    # each video encoded in this many parts at once, on the encoder instances Triton has free (1: whole; metadata-only
    # requests only; a video of fewer temporal patches gets as many parts as it has: backend.protocol.generate.PART_PARAMETER)
    video_split: int = 1
    # before encoding, ask the consumer which items it already holds (backend.transfer.held) and send those as its
    # copies: no encode, no transfer (a request's epd_demand_aware parameter overrides it)
    demand_aware: bool = False
    # between health checks of the replicas of stages on other servers or on several (orchestrator.replicas)
    health_check_seconds: float = 2.0

    def targets(self) -> dict[Stage, tuple[str, str]]:
        """Model name and endpoint of each generator stage this orchestrator may ask over gRPC."""
        return {Stage.DECODE: (self.decode_model, self.decode_endpoint)}

    def health_seconds(self) -> float:
        """``health_check_seconds`` where a stage is remote or replicated (an endpoint other than ``local``), else 0."""
        endpoints = [self.encoder_endpoint, *(endpoint for _, endpoint in self.targets().values())]
        return self.health_check_seconds if any((e or LOCAL).strip() != LOCAL for e in endpoints) else 0.0


@dataclass(frozen=True)
class ProxySettings(OpenAISettings, RoutingSettings, MediaSettings):
    """The ``epd`` model: an orchestrator of its own, asking every generator stage over gRPC."""

    model: str = ""  # the checkpoint, relative to the model repository (its identity and processing options)
    generator_model: str = "pd"
    generator_endpoint: str = LOCAL
    prefill_model: str = "prefill"
    prefill_endpoint: str = LOCAL
    max_images: int = 4
    max_videos: int = 2
    max_audios: int = 3
    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] = ()

    def targets(self) -> dict[Stage, tuple[str, str]]:
        return {Stage.PD: (self.generator_model, self.generator_endpoint),
                Stage.PREFILL: (self.prefill_model, self.prefill_endpoint), **super().targets()}


@dataclass(frozen=True)
class ColocatedSettings(OpenAISettings, RoutingSettings, HeldSettings, KvEngineSettings):
    """An orchestrator in the instances of its host stage (``disaggregation``'s host: pd or prefill), beside its
    engine."""

    orchestrator: str = "colocated"  # written by the renderer, for the reader of config.pbtxt
    # E/P/D: decode's engine runs in this process too (a KV consumer beside prefill's producer; topology
    # stages.decode.orchestrator: colocated): decode's stream reaches the client without a stub or gRPC hop per token
    decode_in_process: bool = False

    def targets(self) -> dict[Stage, tuple[str, str]]:
        return {} if self.decode_in_process else super().targets()


S = typing.TypeVar("S")


def parse_settings(cls: type[S], model: str, config: dict) -> S:
    """``cls`` made of the ``parameters`` of ``model``'s config (Triton's JSON form of config.pbtxt)."""
    hints = typing.get_type_hints(cls)
    known = parameter_fields(cls)
    values = {}
    for key, entry in (config.get("parameters") or {}).items():
        if key not in known:
            raise ConfigError(f"{model}: unknown parameter {key!r} in config.pbtxt (known: {', '.join(sorted(known))})")
        text = entry.get("string_value", "") if isinstance(entry, dict) else str(entry)
        values[known[key]] = _convert(hints[known[key]], text, f"{model}: parameter {key!r} in config.pbtxt")
    return cls(**values)


def parameter_fields(cls: type) -> dict[str, str]:
    """config.pbtxt parameter name -> ``cls``' field it sets (the field's own name, or its ``PARAMETER`` metadata)."""
    return {f.metadata.get(PARAMETER, f.name): f.name for f in fields(cls)}


def defaults(cls: type, *names: str) -> dict[str, typing.Any]:
    """The declared defaults of ``names`` in ``cls``, in that order."""
    declared = {f.name: f.default for f in fields(cls)}
    return {name: declared[name] for name in names}


def _convert(hint, text: str, where: str):
    args = typing.get_args(hint)
    if type(None) in args:
        if text == "":
            return None
        hint = next(arg for arg in args if arg is not type(None))
    if hint is bool:
        if text not in ("true", "false"):
            raise ConfigError(f"{where}: expected true or false, got {text!r}")
        return text == "true"
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise ConfigError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {text!r}") from None
    if typing.get_origin(hint) is tuple:
        return tuple(item.strip() for item in text.split(",") if item.strip())
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(text)
        except ValueError:
            raise ConfigError(f"{where}: expected one of {', '.join(m.value for m in hint)}, got {text!r}") from None
    return text


__all__ = ["ColocatedSettings", "ConfigError", "EncoderSettings", "EngineSettings", "KvEngineSettings",
           "MediaSettings", "ProxySettings", "RoutingSettings", "defaults", "parameter_fields", "parse_settings"]
