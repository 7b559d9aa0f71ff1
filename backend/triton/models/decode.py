"""``decode``: vLLM with NixlConnector as KV consumer. It gets prefill's ``kv_transfer_params`` and the
media items' layout metadata only: the KV it pulls covers the media positions, so no embeddings are
needed, just ``image_grid_thw`` for the prompt's layout (M-RoPE positions, placeholder expansion).
If the KV cannot be loaded the request fails (``kv_load_failure_policy: fail``) instead of being
recomputed without embeddings. P/D: an orchestrator that skips the encoders sends the client's media
(the role's spec, ``backend.protocol.stages``).
"""
from backend.protocol.settings import KvEngineSettings
from backend.protocol.stages import Stage
from backend.triton.counter_batch import after_load
from backend.triton.generate_model import MetadataOnlyModel


@after_load
class TritonPythonModel(MetadataOnlyModel):
    ROLE = Stage.DECODE
    SETTINGS = KvEngineSettings
