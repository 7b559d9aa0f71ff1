"""``epd`` with the orchestrator colocated (topology ``stages.pd.orchestrator: colocated``; decoupled).

One model, one stub per instance: the E+PD orchestrator (``ensemble.orchestrator``) and a vLLM engine fed
metadata-only requests, as ``pd`` is (``backend.generate_model.MetadataOnlyModel``: engine hosting, the
embedding consumer, the pull before submit, vLLM metrics). Same Triton interface as ``llm`` and the proxy
``epd``. Media go to the ``encoder`` model over BLS (``BlsEncoders``), the rewritten metadata-only request
to this instance's own engine (``ensemble.local_stages.LocalStages``), not through tritonserver's gRPC
endpoint to a ``pd`` model: per response, one stub hop and one gRPC round trip fewer. The orchestrator runs
on the engine's event loop.

Adapter only: the logic is ``ensemble.orchestrator`` and ``ensemble.local_stages``.
"""
from __future__ import annotations

from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.encoder import model_identity, processing_options
from backend.generate_model import MetadataOnlyModel, parameter
from ensemble.epd_model import orchestrate
from ensemble.local_stages import LocalStages
from ensemble.orchestrator import Identity, Orchestrator, Topology
from ensemble.triton_stages import BlsEncoders


class TritonPythonModel(MetadataOnlyModel):
    def initialize(self, args):
        super().initialize(args)  # the engine (pd's arguments), the consumer, the metrics, self.limits
        if parameter(self.config, "topology", "E+PD") != "E+PD":
            raise pb_utils.TritonModelException(f"{self.name}: a colocated orchestrator serves E+PD only")
        checkpoint = Path(self.engine_args["model"]).resolve()
        self.stages = LocalStages(BlsEncoders(parameter(self.config, "encoder_model", "encoder")), self.host,
                                  self.resolver, self.limits, prepare=self.prepare, interval=self.stream_interval)
        self.orchestrator = Orchestrator(
            self.stages, Identity(model_identity(checkpoint), processing_options(checkpoint)), self.limits, Topology.E_PD,
            deadline=float(parameter(self.config, "request_timeout_seconds", "300")),
            metadata_only=parameter(self.config, "metadata_only", "true").lower() != "false")

    def execute(self, requests):
        orchestrate(requests, self.orchestrator, self.metrics, self.host.submit)
        return None
