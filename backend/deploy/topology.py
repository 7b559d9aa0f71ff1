"""Deployment topologies: a YAML file names what to serve; ``render`` writes the model repository.

A topology says which deployments run side by side (``serve``: ``baseline`` -> model ``llm``; ``E+PD``
-> ``epd`` + ``encoder`` + ``pd``; ``E/P/D`` -> ``epd`` (``epd_disagg`` when E+PD is served too) +
``encoder`` + ``prefill`` + ``decode``), how many instances each stage has and on which device, the
checkpoint, the shared vLLM engine arguments, and the transfer pool and request limits.

Where a deployment's orchestrator runs (``orchestrator`` on its host stage: ``stages.pd`` for E+PD,
``stages.prefill`` for E/P/D): ``proxy`` (the default) is a model of its own, ``epd``, that reaches the
generator stages over the server's gRPC endpoint; ``colocated`` runs it inside each instance of the host stage,
beside the instance's vLLM engine. E+PD is then ``encoder`` + ``epd`` (with ``pd``'s instances and device;
no model named ``pd``): per streamed response one stub hop and one gRPC round trip fewer. E/P/D is ``encoder`` +
``epd`` (with ``prefill``'s instances and device, a KV producer that pulls the embeddings; no model named
``prefill``) + ``decode``, still asked over gRPC and relayed token by token: the prefill stage's own stub, its
gRPC call and tritonserver's share of it go. Encoders stay a separate model reached through
BLS either way, and the engines still take metadata-only requests. Example::

    checkpoint: ../models/tiny-qwen2-vl      # relative to this file
    serve: [E/P/D]
    stages:
      encoder: {instances: 2, device: cpu}
      prefill: {instances: 1, device: cpu}
      decode:  {instances: 1, device: cpu}
      epd:     {instances: 1}
    engine_args: {dtype: float32, enforce_eager: true, max_model_len: 4096}
    transfer: {pool_bytes: 67108864, lease_seconds: 30}

    python -m backend.deploy.topology render topologies/cpu-e-p-d.yaml --out /tmp/repo
    python -m backend.deploy.topology check topologies/gpu-e-p-d.yaml --machine gpu

An orchestrator reaches ``pd``, ``prefill`` and ``decode`` over gRPC at their ``endpoint`` (a stage key):
``local`` (the default) is the server the orchestrator runs in, whatever ports it was started on
(``backend.deploy.server_address``); ``host:port`` is another server.

Validation is loud: unknown keys, impossible counts, a stage the deployments do not use, a GPU asked
for on a CPU machine, each named. The committed ``model_repository/`` is the rendering of
``topologies/default.yaml`` (a test checks they agree).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from backend.deploy.server_address import LOCAL, EndpointError, check_endpoint

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = {"baseline": ("llm",), "E+PD": ("encoder", "pd", "epd"), "E/P/D": ("encoder", "prefill", "decode", "epd")}
ENGINE_STAGES = ("llm", "pd", "prefill", "decode")
GPU_STAGES = ("encoder", "llm", "pd", "prefill", "decode")
MAX_INSTANCES = 16
TOP_KEYS = {"name", "checkpoint", "serve", "stages", "engine_args", "transfer", "limits", "stream_interval_ms"}
STAGE_KEYS = {"instances", "device", "gpus", "orchestrator", "endpoint"}
REMOTE_STAGES = ("pd", "prefill", "decode")  # reached by an orchestrator over gRPC: they take an endpoint
ORCHESTRATORS = ("proxy", "colocated")  # stages.<host>.orchestrator: where a deployment's orchestrator runs
HOSTS = {"E+PD": "pd", "E/P/D": "prefill"}  # deployment -> the stage that can host its orchestrator
COLOCATED = "epd:E+PD:colocated"  # model kind: E+PD's orchestrator and the pd engine in one model
COLOCATED_PREFILL = "epd:E/P/D:colocated"  # model kind: E/P/D's orchestrator and the prefill engine in one model
COLOCATED_KINDS = {"E+PD": COLOCATED, "E/P/D": COLOCATED_PREFILL}
TRANSFER_DEFAULTS = {"pool_bytes": 64 << 20, "lease_seconds": 30, "alloc_timeout_seconds": 1.0, "nixl_poll_delay_us": 5000}
LIMIT_DEFAULTS = {"max_images": 4, "max_image_pixels": 16_000_000, "max_item_bytes": 32 << 20,
                  "request_timeout_seconds": 300}  # the last: epd's deadline per request (encode to last token)
ENGINE_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 32,
                   "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni", "seed": 0,
                   "disable_log_stats": True}


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class StageSpec:
    instances: int = 1
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    orchestrator: str = "proxy"  # pd / prefill (HOSTS): "colocated" runs the deployment's orchestrator in its instances
    endpoint: str = "local"  # REMOTE_STAGES: where the orchestrator reaches it over gRPC (backend.deploy.server_address)


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

    def only(self, mode: str | tuple[str, ...], engine_args: dict[str, Any] | None = None, **changes) -> "Topology":
        """This topology serving ``mode`` (a deployment, or several side by side) alone (their stages only),
        with ``engine_args`` laid over its own and other fields replaced by ``changes``."""
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
        unknown = [m for m in modes if m not in DEPLOYMENTS]
        if unknown or not modes:
            raise TopologyError(f"unknown deployment {', '.join(map(repr, unknown))}; known: {', '.join(DEPLOYMENTS)}")
        colocated = self.colocated
        stages = [stage for m in modes for stage in deployment_stages(m, colocated)]
        missing = sorted({stage for stage in stages if stage not in self.stages})
        if missing:
            raise TopologyError(f"{self.name}: cannot serve {' + '.join(modes)} alone, no settings for {', '.join(missing)}")
        return replace(self, name=f"{self.name}-{'-'.join(modes)}", serve=modes, checkpoint=self.checkpoint.resolve(),
                       stages={s: self.stages[s] for s in stages},
                       engine_args={**self.engine_args, **(engine_args or {})}, **changes)

    @property
    def colocated(self) -> tuple[str, ...]:
        """The served deployments whose orchestrator runs inside their host stage's instances
        (``stages.pd.orchestrator`` / ``stages.prefill.orchestrator: colocated``)."""
        return tuple(mode for mode in self.serve if mode in HOSTS and HOSTS[mode] in self.stages
                     and self.stages[HOSTS[mode]].orchestrator == "colocated")

    def with_orchestrator(self, where: str, mode: str = "E+PD") -> "Topology":
        """This topology with ``mode``'s orchestrator ``proxy`` or ``colocated``: the settings of the stages the
        deployments then use (an ``epd`` stage nothing uses is dropped; a proxy without one gets the defaults,
        as in a file)."""
        if where not in ORCHESTRATORS:
            raise TopologyError(f"{self.name}: orchestrator: expected one of {', '.join(ORCHESTRATORS)}, got {where!r}")
        if mode not in HOSTS or mode not in self.serve:
            raise TopologyError(f"{self.name}: orchestrator {where}: {mode} has no orchestrator to place here "
                                f"(served: {', '.join(self.serve)}; orchestrators: {', '.join(HOSTS)})")
        host = HOSTS[mode]
        stages = {"epd": StageSpec(), **self.stages, host: replace(self.stages[host], orchestrator=where)}
        colocated = tuple(m for m in HOSTS if stages.get(HOSTS[m], StageSpec()).orchestrator == "colocated")
        needed = {stage for m in self.serve for stage in deployment_stages(m, colocated)}
        return replace(self, stages={s: spec for s, spec in stages.items() if s in needed})

    def models(self) -> dict[str, str]:
        """Model name -> kind (llm, encoder, pd, prefill, decode, epd:E+PD, epd:E/P/D, and the COLOCATED_KINDS:
        a deployment's orchestrator with its host stage's engine, in place of that stage's model)."""
        out: dict[str, str] = {}
        colocated = self.colocated
        for mode in self.serve:
            for stage in DEPLOYMENTS[mode]:
                if stage == "epd":
                    name = "epd" if "epd" not in out else "epd_disagg"
                    out[name] = COLOCATED_KINDS[mode] if mode in colocated else f"epd:{mode}"
                elif not (mode in colocated and stage == HOSTS[mode]):
                    out[stage] = stage
        return out


def deployment_stages(mode: str, colocated: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The stages whose settings ``mode`` uses: a deployment in ``colocated`` has no ``epd`` stage of its own
    (its orchestrator runs in the instances of its host stage, ``HOSTS``)."""
    if mode in colocated:
        return tuple(stage for stage in DEPLOYMENTS[mode] if stage != "epd")
    return DEPLOYMENTS[mode]


def _check_keys(doc: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def load(path: Path, machine: str | None = None, checkpoint: Path | None = None) -> Topology:
    """The topology in ``path`` for a ``machine`` kind (default: this one's); ``checkpoint``: a checkpoint directory
    that replaces the file's (which must then exist and hold a config.json)."""
    path, override = Path(path), checkpoint
    if override is not None and not (Path(override) / "config.json").is_file():
        raise TopologyError(f"checkpoint {override}: not a checkpoint directory (no config.json)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(doc, dict):
        raise TopologyError(f"{path}: expected a mapping at the top level")
    _check_keys(doc, TOP_KEYS, str(path))
    machine = machine or ("gpu" if Path("/dev/nvidia0").exists() else "cpu")
    serve = doc.get("serve")
    if not isinstance(serve, list) or not serve or any(mode not in DEPLOYMENTS for mode in serve) or len(set(serve)) != len(serve):
        raise TopologyError(f"{path}: serve must list distinct deployments out of {', '.join(DEPLOYMENTS)}; got {serve!r}")
    checkpoint = doc.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise TopologyError(f"{path}: checkpoint: expected the path of the model checkpoint")
    stages_doc = doc.get("stages") or {}
    if not isinstance(stages_doc, dict):
        raise TopologyError(f"{path}: stages: expected a mapping of stage -> settings")
    colocated = tuple(mode for mode, host in HOSTS.items() if mode in serve and isinstance(stages_doc.get(host), dict)
                      and stages_doc[host].get("orchestrator") == "colocated")
    needed = {stage for mode in serve for stage in deployment_stages(mode, colocated)}
    unused = sorted(set(stages_doc) - needed)
    if unused:
        why = "".join(f" ({HOSTS[mode]}.orchestrator is colocated: {mode}'s orchestrator runs in the {HOSTS[mode]} instances)"
                      for mode in colocated if "epd" in unused)
        raise TopologyError(f"{path}: stages: {', '.join(unused)} not used by serve {serve} "
                            f"(uses {', '.join(sorted(needed))}){why}")
    stages = {stage: _stage(stages_doc.get(stage) or {}, f"{path}: stages.{stage}", stage, machine) for stage in sorted(needed)}
    sections = {}
    for key, defaults in (("transfer", TRANSFER_DEFAULTS), ("limits", LIMIT_DEFAULTS)):
        section = doc.get(key) or {}
        if not isinstance(section, dict):
            raise TopologyError(f"{path}: {key}: expected a mapping")
        _check_keys(section, set(defaults), f"{path}: {key}")
        for k, v in section.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise TopologyError(f"{path}: {key}.{k}: expected a positive number, got {v!r}")
        sections[key] = {**defaults, **section}
    engine_args = doc.get("engine_args") or {}
    if not isinstance(engine_args, dict) or "model" in engine_args:
        raise TopologyError(f"{path}: engine_args: expected a mapping of vLLM engine arguments (the model is 'checkpoint')")
    interval = doc.get("stream_interval_ms", 0)
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval < 0:
        raise TopologyError(f"{path}: stream_interval_ms: expected a number >= 0, got {interval!r}")
    return Topology(name=str(doc.get("name") or path.stem),
                    checkpoint=Path(override).resolve() if override is not None else path.parent / checkpoint,
                    serve=tuple(serve), stages=stages, engine_args={**ENGINE_DEFAULTS, **engine_args},
                    transfer=sections["transfer"], limits=sections["limits"], stream_interval_ms=float(interval))


def _stage(doc: dict, where: str, stage: str, machine: str) -> StageSpec:
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping with instances / device / gpus")
    _check_keys(doc, STAGE_KEYS, where)
    instances = doc.get("instances", 1)
    if not isinstance(instances, int) or isinstance(instances, bool) or not 1 <= instances <= MAX_INSTANCES:
        raise TopologyError(f"{where}.instances: expected an integer from 1 to {MAX_INSTANCES}, got {instances!r}")
    device = doc.get("device", "cpu")
    if device not in ("cpu", "gpu"):
        raise TopologyError(f"{where}.device: expected cpu or gpu, got {device!r}")
    if device == "gpu" and stage not in GPU_STAGES:
        raise TopologyError(f"{where}.device: the {stage} stage runs on CPU only")
    if device == "gpu" and machine != "gpu":
        raise TopologyError(f"{where}.device: gpu asked for, but this machine kind is {machine} (no GPU); "
                            f"use device: cpu or render with --machine gpu for a GPU machine")
    gpus = doc.get("gpus", [0] if device == "gpu" else [])
    if not isinstance(gpus, list) or not all(isinstance(g, int) and g >= 0 for g in gpus):
        raise TopologyError(f"{where}.gpus: expected a list of GPU ids")
    if gpus and device != "gpu":
        raise TopologyError(f"{where}.gpus: only for device: gpu")
    orchestrator = doc.get("orchestrator", "proxy")
    if "orchestrator" in doc and stage not in HOSTS.values():
        raise TopologyError(f"{where}.orchestrator: only pd (E+PD's) or prefill (E/P/D's) can host an orchestrator")
    if orchestrator not in ORCHESTRATORS:
        raise TopologyError(f"{where}.orchestrator: expected one of {', '.join(ORCHESTRATORS)}, got {orchestrator!r}")
    endpoint = doc.get("endpoint", LOCAL)
    if "endpoint" in doc and stage not in REMOTE_STAGES:
        raise TopologyError(f"{where}.endpoint: only {', '.join(REMOTE_STAGES)} are reached over gRPC "
                            f"(the encoder is reached through BLS, in the same server)")
    if "endpoint" in doc and orchestrator == "colocated":
        raise TopologyError(f"{where}.endpoint: this stage runs inside its colocated orchestrator; nothing reaches it over gRPC")
    try:
        check_endpoint(stage, endpoint if isinstance(endpoint, str) else repr(endpoint))
    except EndpointError as exc:
        raise TopologyError(f"{where.rsplit(': ', 1)[0]}: {exc}") from None
    return StageSpec(instances, device, tuple(gpus), orchestrator, endpoint)


# -- rendering ---------------------------------------------------------------------------------------
_GEN_INPUTS = [("text_input", "TYPE_STRING", 1), ("messages", "TYPE_STRING", 1), ("image", "TYPE_STRING", -1),
               ("stream", "TYPE_BOOL", 1), ("sampling_parameters", "TYPE_STRING", 1),
               ("exclude_input_in_output", "TYPE_BOOL", 1), ("return_num_input_tokens", "TYPE_BOOL", 1),
               ("return_num_output_tokens", "TYPE_BOOL", 1)]
_GEN_OUTPUTS = [("text_output", "TYPE_STRING"), ("finish_reason", "TYPE_STRING"),
                ("num_input_tokens", "TYPE_UINT32"), ("num_output_tokens", "TYPE_UINT32")]
_HEADERS = {
    "llm": "Single-engine baseline: one vLLM AsyncLLM given the raw media (engine arguments in model.json).\n"
           "Its inputs/outputs are the interface every generating model shares (llm, epd, pd, ...).",
    "pd": "E+PD consumer: one vLLM AsyncLLM (prefill + decode) fed metadata-only media (image_layouts); it pulls\n"
          "the embeddings through NIXL. It receives media (original_media) only when the orchestrator runs with\n"
          "metadata-only off (naive EPD) and then decodes and preprocesses them itself. Engine arguments in model.json.",
    "prefill": "E/P/D prefill: vLLM with NixlConnector (kv_producer) fed metadata-only media (image_layouts); it pulls\n"
               "the embeddings, prefills, and returns kv_transfer_params for decode. Given media (image; P/D: the\n"
               "orchestrator skipped the encoders, request parameter epd_encode=false), its engine processes them.\n"
               "Engine arguments in model.json.",
    "decode": "E/P/D decode: vLLM with NixlConnector (kv_consumer). It pulls prefill's KV by kv_transfer_params and\n"
              "takes media as layout metadata only (no embeddings): the KV covers the media positions. Given media\n"
              "(image; P/D, as prefill), its engine processes them.",
    "encoder": "Encoder stage: image processor + vision tower of the checkpoint (tower weights only). Each item's\n"
               "embeddings go into a NIXL-registered lease; the response is the item's layout metadata (JSON).\n"
               "Triton's dynamic batcher gathers items of concurrent requests into one tower forward.",
    "epd:E+PD": "E+PD orchestrator (decoupled): the same interface as llm. Media items go to `encoder` concurrently (BLS);\n"
                "the request goes on to `pd` metadata-only (image_layouts, over the server's gRPC endpoint); pd's stream\n"
                "comes back with a timing breakdown.",
    COLOCATED: "E+PD with the orchestrator colocated (decoupled): the same interface as llm. Media items go to `encoder`\n"
               "concurrently (BLS); the metadata-only request goes to this model's own vLLM AsyncLLM (prefill + decode, as\n"
               "pd: it pulls the embeddings by handle, never sees media), in process; the stream comes back with a timing\n"
               "breakdown. Engine arguments in model.json.",
    COLOCATED_PREFILL: "E/P/D with the orchestrator colocated with prefill (decoupled): the same interface as llm. Media items\n"
                       "go to `encoder` concurrently (BLS); the metadata-only request goes to this model's own vLLM AsyncLLM\n"
                       "(prefill: NixlConnector kv_producer, pulls the embeddings by handle; 1 token, do_remote_decode), in\n"
                       "process, then to `decode` with its kv_transfer_params over the server's gRPC endpoint; decode's stream\n"
                       "comes back with a timing breakdown. Engine arguments in model.json.",
    "epd:E/P/D": "E/P/D orchestrator (decoupled): media items go to `encoder` concurrently (BLS); the metadata-only\n"
                 "request goes to `prefill` (1 token, do_remote_decode) and then to `decode` with prefill's\n"
                 "kv_transfer_params; decode's stream comes back with a timing breakdown.",
}
_MODULES = {"llm": "backend.triton.models.llm", "pd": "backend.triton.models.pd", "prefill": "backend.triton.models.prefill",
            "decode": "backend.triton.models.decode", "encoder": "backend.triton.models.encoder",
            COLOCATED: "backend.triton.models.colocated", COLOCATED_PREFILL: "backend.triton.models.colocated"}


def _io(kind: str, items) -> str:
    lines = []
    for item in items:
        name, dtype, dims = item if len(item) == 3 else (*item, -1)
        optional = " optional: true" if kind == "input" else ""
        lines.append(f'  {{ name: "{name}" data_type: {dtype} dims: [ {dims} ]{optional} }}')
    return f"{kind} [\n" + ",\n".join(lines) + "\n]\n"


def _params(params: dict[str, Any]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def _instances(spec: StageSpec) -> str:
    if spec.device == "gpu":
        return f"instance_group [ {{ count: {spec.instances} kind: KIND_GPU gpus: [ {', '.join(map(str, spec.gpus))} ] }} ]\n"
    return f"instance_group [ {{ count: {spec.instances} kind: KIND_CPU }} ]\n"


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_config(topology: Topology, name: str, kind: str, model_dir: Path) -> str:
    checkpoint = os.path.relpath(topology.checkpoint.resolve(), model_dir.resolve())
    limits = {k: _fmt(v) for k, v in topology.limits.items() if k not in ("max_images", "request_timeout_seconds")}
    header = "".join(f"# {line}\n" for line in _HEADERS[kind].splitlines())
    body = f'name: "{name}"\nbackend: "python"\n'
    if kind == "encoder":
        spec = topology.stages["encoder"]
        body += "max_batch_size: 32\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n\n"
        body += _io("input", [("image", "TYPE_STRING", 1)]).replace(
            "dims: [ 1 ] optional: true", "dims: [ 1 ]").replace("\n]", ',\n  { name: "content_key" data_type: TYPE_STRING dims: [ 1 ] optional: true }\n]')
        body += _io("output", [("layout", "TYPE_STRING", 1)]) + "\n" + _instances(spec) + "\n"
        transfer = {k: _fmt(v) for k, v in topology.transfer.items() if k != "nixl_poll_delay_us"}
        # the tower runs in the engines' dtype (a bfloat16 checkpoint served in float32: the engines' own tower
        # computes in float32, and embeddings of another dtype would change the tokens)
        dtype = topology.engine_args.get("dtype")
        engine_dtype = {"encoder_dtype": dtype} if isinstance(dtype, str) and dtype != "auto" else {}
        return header + body + _params({"model": checkpoint, **engine_dtype, **transfer, **limits})
    body += "max_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n\n"
    if kind in COLOCATED_KINDS.values():
        mode = kind.split(":")[1]
        body += _io("input", _GEN_INPUTS) + _io("output", _GEN_OUTPUTS + [("timings", "TYPE_STRING")])
        body += "\n" + _instances(topology.stages[HOSTS[mode]]) + "\n"
        params = {"engine_args": "model.json", **limits, "topology": mode, "orchestrator": "colocated",
                  "encoder_model": "encoder", "request_timeout_seconds": _fmt(topology.limits["request_timeout_seconds"])}
        if mode == "E/P/D":  # decode over gRPC; this model's engine is prefill's (a KV producer)
            params.update(decode_model="decode", decode_endpoint=topology.stages["decode"].endpoint, nixl_side_channel_port="",
                          nixl_poll_delay_us=_fmt(topology.transfer["nixl_poll_delay_us"]))
        if topology.stream_interval_ms:
            params["stream_interval_ms"] = _fmt(topology.stream_interval_ms)
        return header + body + _params(params)
    if kind.startswith("epd:"):
        mode = kind.split(":", 1)[1]
        body += _io("input", _GEN_INPUTS) + _io("output", _GEN_OUTPUTS + [("timings", "TYPE_STRING")])
        body += "\n" + _instances(topology.stages["epd"]) + "\n"
        names = {"model": checkpoint, "topology": mode, "encoder_model": "encoder"}
        names.update({"generator_model": "pd", "generator_endpoint": topology.stages["pd"].endpoint} if mode == "E+PD" else
                     {"prefill_model": "prefill", "prefill_endpoint": topology.stages["prefill"].endpoint,
                      "decode_model": "decode", "decode_endpoint": topology.stages["decode"].endpoint})
        if topology.engine_args.get("allowed_media_domains"):  # vLLM's engine argument applies to epd too
            names["allowed_media_domains"] = ",".join(topology.engine_args["allowed_media_domains"])
        return header + body + _params({**names, "max_images": _fmt(topology.limits["max_images"]), **limits,
                                        "request_timeout_seconds": _fmt(topology.limits["request_timeout_seconds"])})
    inputs, outputs = list(_GEN_INPUTS), list(_GEN_OUTPUTS)
    if kind != "llm":
        inputs[2] = ("image_layouts", "TYPE_STRING", -1)
        inputs.append(("original_media", "TYPE_STRING", -1))  # metadata-only off (naive EPD) only
        outputs.append(("timings", "TYPE_STRING"))
    if kind in ("prefill", "decode"):
        inputs.append(("image", "TYPE_STRING", -1))  # P/D: an orchestrator that skips the encoders (epd_encode)
        inputs.append(("kv_transfer_params", "TYPE_STRING", 1))
        outputs.append(("kv_transfer_params", "TYPE_STRING"))
    body += _io("input", inputs) + _io("output", outputs) + "\n" + _instances(topology.stages[kind]) + "\n"
    params = {"engine_args": "model.json", **limits}
    if topology.stream_interval_ms and kind != "prefill":
        params["stream_interval_ms"] = _fmt(topology.stream_interval_ms)
    if kind in ("prefill", "decode"):
        params.update(nixl_side_channel_port="", nixl_poll_delay_us=_fmt(topology.transfer["nixl_poll_delay_us"]))
    return header + body + _params(params)


def render_engine_args(topology: Topology, kind: str, model_dir: Path) -> str:
    args = {"model": os.path.relpath(topology.checkpoint.resolve(), model_dir.resolve()), **topology.engine_args,
            "limit_mm_per_prompt": {"image": topology.limits["max_images"]}}
    if topology.stages[kind].device == "gpu":
        args.pop("distributed_executor_backend", None)
    return json.dumps(args, indent=2) + "\n"


def render_files(topology: Topology, out: Path) -> dict[str, str]:
    """The model repository for ``topology`` as it would be written at ``out``: relative path -> text."""
    files = {}
    for name, kind in topology.models().items():
        model_dir = Path(out) / name
        files[f"{name}/config.pbtxt"] = render_config(topology, name, kind, model_dir)
        module = _MODULES.get(kind) or "backend.triton.models.epd"
        files[f"{name}/1/model.py"] = (f'"""Triton Python-backend entry point of `{name}`: the model class lives in '
                                       f'{module}."""\nfrom {module} import TritonPythonModel  # noqa: F401\n')
        if kind in ENGINE_STAGES or kind in COLOCATED_KINDS.values():
            host = HOSTS[kind.split(":")[1]] if kind in COLOCATED_KINDS.values() else kind
            files[f"{name}/model.json"] = render_engine_args(topology, host, model_dir)
    return files


def render(topology: Topology, out: Path) -> list[str]:
    """Write the model repository for ``topology`` into ``out`` (replacing what is there)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    for relative, text in render_files(topology, out).items():
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_text(text)
    return list(topology.models())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate a deployment topology and render its model repository.")
    parser.add_argument("command", choices=("render", "check"))
    parser.add_argument("topology", type=Path)
    parser.add_argument("--out", type=Path, help="model repository to write (render)")
    parser.add_argument("--machine", choices=("cpu", "gpu"), help="the machine kind it is for (default: this one)")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint directory instead of the topology's")
    args = parser.parse_args(argv)
    try:
        topology = load(args.topology, args.machine, args.checkpoint)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(f"{args.topology}: ok; models: {', '.join(topology.models())}")
        return 0
    if args.out is None:
        parser.error("render needs --out")
    names = render(topology, args.out)
    print(f"rendered {', '.join(names)} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
