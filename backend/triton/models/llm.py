"""``llm``: the single-engine baseline. One in-process vLLM AsyncLLM, given the raw media.

Adapter only (see DESIGN.md): ``backend.triton.generate_model`` reads the config, hosts the engine and
streams; here we say that media are decoded in this model.
"""
from backend.triton.counter_batch import after_load
from backend.triton.generate_model import GenerateModel
from backend.request.generate import DecodeMedia
from backend.protocol.settings import LlmSettings


@after_load
class TritonPythonModel(GenerateModel):
    SETTINGS = LlmSettings

    def make_resolver(self):
        return DecodeMedia(self.limits.media)
