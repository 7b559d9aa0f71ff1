"""An orchestrator colocated with the engine of the stage given the embeddings: pd (E+PD) or prefill (E/P/D).

Topology ``stages.pd.orchestrator: colocated`` (E+PD, model ``epd``) or ``stages.prefill.orchestrator: colocated``
(E/P/D, model ``epd``, or ``epd_disagg`` beside E+PD). One model, one stub per instance: the orchestrator
(``orchestrator.core``) and a vLLM engine fed metadata-only requests, hosted as the stage's own model hosts
it (``backend.triton.generate_model.MetadataOnlyModel``: engine, vLLM metrics, the ``prepare`` step):

- E+PD: pd's engine (prefill + decode); ``prepare`` pulls the embeddings by handle (the consumer lives here);
- E/P/D: prefill's engine (NixlConnector ``kv_producer``, prefill's role spec in ``backend.protocol.stages``); ``prepare``
  pulls the embeddings by handle, as for pd. Decode stays a model of its own, asked over the server's gRPC
  endpoint (``triton_stages``; the ``decode_endpoint`` parameter, ``local``: this server's, ``backend.deploy.server_address``)
  with prefill's ``kv_transfer_params``; its stream is relayed to the client. Or, with ``decode_in_process``
  (topology ``stages.decode.orchestrator: colocated``), decode's engine (``kv_consumer``) runs here too, on the same
  event loop: the KV still moves between the two EngineCores through NIXL, and decode's tokens reach the client
  without a stub, tritonserver or gRPC hop each.

Same Triton interface as ``llm`` and the proxy orchestrator ``epd``. Media go to the ``encoder`` model over BLS,
the host stage runs in process (``orchestrator.local_stages.LocalStages``): one stub hop and one gRPC round trip
fewer per response of that stage than the proxy orchestrator. The orchestrator runs on the engine's event loop.

Adapter only: the logic is ``orchestrator.core`` and ``orchestrator.local_stages``.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encode.checkpoint import model_identity, processing_options
from backend.protocol.settings import ColocatedSettings
from backend.protocol.stages import Disaggregation
from backend.engine.host import EngineHost
from backend.protocol.stages import Stage
from backend.triton.counter_batch import after_load
from backend.triton.generate_model import MetadataOnlyModel
from backend.triton.metrics import EngineMetrics
from backend.deploy.server_address import EndpointError
from backend.triton.io import orchestrate
from orchestrator.admission import Admission
from orchestrator.core import Identity, Orchestrator
from orchestrator.local_stages import LocalEngine, LocalStages
from backend.triton.stage_client import BlsEncoders, encoder_urls, stage_urls, triton_stages


@after_load
class TritonPythonModel(MetadataOnlyModel):
    SETTINGS = ColocatedSettings

    def initialize(self, args):
        self.watch, self.decode = None, None
        super().initialize(args)  # the engine (the host stage's, role_spec), the consumer, the metrics, self.limits
        settings, disaggregation = self.settings, self.settings.disaggregation
        if not self.urls and self.encoders is None:
            remote = BlsEncoders(settings.encoder_model)
        else:  # decode (E/P/D) or the encoders (encoder_endpoint) on other servers, or on several
            remote = triton_stages(self.urls, settings.encoder_model, decode_model=settings.decode_model,
                                   encoders=self.encoders, health_seconds=settings.health_seconds())
            self.watch = self.host.submit(remote.watch())
        others = {}
        if self.decode is not None:  # started in start_more_engines
            others[Stage.DECODE] = LocalEngine(self.decode, self.resolver, self.prepare_decode)
        checkpoint = Path(self.engine_args["model"]).resolve()
        self.stages = LocalStages(remote, self.host, self.resolver, self.limits, prepare=self.prepare,
                                  interval=self.stream_interval, local=disaggregation.host,
                                  held=self.held.lookup if self.held is not None else None, others=others)
        self.orchestrator = Orchestrator(
            self.stages, Identity(model_identity(checkpoint), processing_options(checkpoint)), self.limits,
            disaggregation, deadline=settings.request_timeout_seconds, metadata_only=settings.metadata_only,
            video_split=settings.video_split, demand_aware=settings.demand_aware,
            admission=Admission(settings, self.metrics))
        self.serve_openai(self.orchestrator.answerer(self.metrics))

    def start_more_engines(self, args) -> None:
        if self.settings.decode_in_process:
            self.decode = self.start_decode(args)

    def start_decode(self, args) -> EngineHost:
        """E/P/D's decode engine in this process (``decode_in_process``): a KV consumer with this model's engine
        arguments, its own NIXL side channel and idle wait, on the host engine's loop; its vLLM metrics labelled
        as the ``decode`` model's would be (``decode_model``)."""
        spec = self.decode_spec = replace(Stage.DECODE.spec, takes_media=False)
        self.decode_metrics = EngineMetrics(self.settings.decode_model, self.metric_batch,
                                            args.get("model_instance_name", ""))
        return self.start_engine(self.with_kv_role(self.engine_args, spec), self.decode_metrics, spec, beside=self.host)

    async def prepare_decode(self, request):
        """Decode's engine request, as the ``decode`` model prepares it: the layouts' grids only (its KV covers the
        media positions), after the media work of a naive consumer where metadata-only is off."""
        return await self.prepare(request, self.decode_spec)

    def check_settings(self):
        if self.settings.decode_in_process and self.settings.disaggregation is not Disaggregation.E_P_D:
            raise pb_utils.TritonModelException(f"{self.name}: decode_in_process: only an E/P/D orchestrator has decode")
        try:  # E/P/D: decode's address, before the engine starts (a wrong one fails the load at once)
            self.urls = stage_urls(self.settings.targets(), [
                stage for stage in self.settings.disaggregation.generators[1:] if stage in self.settings.targets()])
            self.encoders = encoder_urls(self.settings.encoder_model, self.settings.encoder_endpoint)
        except EndpointError as exc:
            raise pb_utils.TritonModelException(f"{self.name}: {exc}") from None

    def role_spec(self):
        """The host stage's engine (pd's, or prefill's: a KV producer that pulls the embeddings), given layouts
        only: the orchestrator in this process always encodes the media first."""
        return replace(self.settings.disaggregation.host.spec, takes_media=False)

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
        if self.decode is not None:  # before the host engine's, whose loop it runs on
            self.decode.shutdown()
            self.decode_metrics.close()
        super().finalize()
