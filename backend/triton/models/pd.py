"""``pd``: prefill + decode on one vLLM AsyncLLM, fed metadata-only media.

Each media item arrives as layout metadata (``image_layouts``); before a request is submitted, its
embeddings are pulled from the encoder's buffer (``backend.triton.generate_model.MetadataOnlyModel``). A failed
or expired pull fails that request with UNAVAILABLE and nothing reaches vLLM. This model never
receives or decodes media.
"""
from backend.protocol.settings import PdSettings
from backend.protocol.stages import Stage
from backend.triton.counter_batch import after_load
from backend.triton.generate_model import MetadataOnlyModel


@after_load
class TritonPythonModel(MetadataOnlyModel):
    ROLE = Stage.PD
    SETTINGS = PdSettings
