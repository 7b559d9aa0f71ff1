"""An orchestrator colocated with the engine of the stage given the embeddings: pd (E+PD) or prefill (E/P/D).

Topology ``stages.pd.orchestrator: colocated`` (E+PD, model ``epd``) or ``stages.prefill.orchestrator: colocated``
(E/P/D, model ``epd``, or ``epd_disagg`` beside E+PD). One model, one stub per instance: the orchestrator
(``ensemble.orchestrator``) and a vLLM engine fed metadata-only requests, hosted as the stage's own model hosts
it (``backend.triton.generate_model.MetadataOnlyModel``: engine, vLLM metrics, the ``prepare`` step):

- E+PD: pd's engine (prefill + decode); ``prepare`` pulls the embeddings by handle (the consumer lives here);
- E/P/D: prefill's engine (NixlConnector ``kv_producer``, the settings of ``backend.triton.models.prefill``); ``prepare``
  pulls the embeddings by handle, as for pd. Decode stays a model of its own, asked over the server's gRPC
  endpoint (``TritonStages``; the ``decode_endpoint`` parameter, ``local``: this server's, ``backend.deploy.server_address``)
  with prefill's ``kv_transfer_params``; its stream is relayed to the client.

Same Triton interface as ``llm`` and the proxy ``epd``. Media go to the ``encoder`` model over BLS, the host
stage runs in process (``ensemble.local_stages.LocalStages``): one stub hop and one gRPC round trip fewer per
response of that stage than the proxy. The orchestrator runs on the engine's event loop.

Adapter only: the logic is ``ensemble.orchestrator`` and ``ensemble.local_stages``.
"""
from __future__ import annotations

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encode.checkpoint import model_identity, processing_options
from backend.triton.generate_model import MetadataOnlyModel, parameter
from backend.triton.models.prefill import TritonPythonModel as PrefillModel
from backend.deploy.server_address import EndpointError
from backend.triton.models.epd import orchestrate
from ensemble.local_stages import LocalStages
from ensemble.orchestrator import Identity, Orchestrator, Stage, Topology
from backend.triton.stage_client import BlsEncoders, TritonStages, stage_urls


class TritonPythonModel(MetadataOnlyModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        try:
            self.mode = Topology(parameter(config, "topology", "E+PD"))
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"{args['model_name']}: parameter topology: {exc}") from None
        try:  # E/P/D: decode's address, before the engine starts (a wrong one fails the load at once)
            urls = stage_urls(lambda name, default: parameter(config, name, default),
                              (Stage.DECODE,) if self.mode is Topology.E_P_D else ())
        except EndpointError as exc:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {exc}") from None
        self.watch = None
        if self.mode is Topology.E_P_D:  # this engine is prefill's: KV producer, pulls the embeddings
            self.KV_ROLE, self.IDLE_WAIT_MS = PrefillModel.KV_ROLE, PrefillModel.IDLE_WAIT_MS
        super().initialize(args)  # the engine (the host stage's arguments), the consumer, the metrics, self.limits
        encoders = parameter(self.config, "encoder_model", "encoder")
        if self.mode is Topology.E_PD:
            remote, local = BlsEncoders(encoders), Stage.GENERATE
        else:
            remote = TritonStages(urls, encoders, decode_model=parameter(self.config, "decode_model", "decode"))
            self.watch = self.host.submit(remote.watch())
            local = Stage.PREFILL
        checkpoint = Path(self.engine_args["model"]).resolve()
        self.stages = LocalStages(remote, self.host, self.resolver, self.limits, prepare=self.prepare,
                                  interval=self.stream_interval, local=local)
        self.orchestrator = Orchestrator(
            self.stages, Identity(model_identity(checkpoint), processing_options(checkpoint)), self.limits, self.mode,
            deadline=float(parameter(self.config, "request_timeout_seconds", "300")),
            metadata_only=parameter(self.config, "metadata_only", "true").lower() != "false")

    def execute(self, requests):
        orchestrate(requests, self.orchestrator, self.metrics, self.host.submit, self.cancels)
        return None

    def finalize(self):
        if self.watch is not None:
            self.watch.cancel()
        try:
            self.host.submit(self.stages.aclose()).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - unloading anyway
            pb_utils.Logger.log_warn(f"{self.name}: closing the stage client: {exc}")
        super().finalize()
