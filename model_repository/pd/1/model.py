"""``pd``: prefill + decode on one vLLM AsyncLLM, fed metadata-only media.

Each media item arrives as layout metadata (``image_layouts``); before a request is submitted, its
embeddings are pulled from the encoder's NIXL buffer (``prepare``). A failed or expired pull fails that
request with UNAVAILABLE and nothing reaches vLLM. This model never receives or decodes media.
"""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from backend.encoder import model_identity
from backend.generate_model import GenerateModel
from backend.request import LayoutMedia
from backend.transfer.consumer import EmbeddingConsumer, pull_image_embeds


class TritonPythonModel(GenerateModel):
    def initialize(self, args):
        super().initialize(args)
        self.consumer = EmbeddingConsumer(role=f"{self.name}")
        self.pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding-pull")  # one NIXL agent user

    def extra_engine_args(self):
        return {"enable_mm_embeds": True}

    def make_resolver(self):
        return LayoutMedia(model_identity(self.engine_args["model"]))

    async def prepare(self, request):
        if not request.images:
            return request
        started = time.perf_counter()
        embeds = await asyncio.get_running_loop().run_in_executor(
            self.pulls, pull_image_embeds, self.consumer, request.images)
        timings = {"transfer_ms": round((time.perf_counter() - started) * 1000, 3),
                   "transfer_bytes": sum(layout.handle.nbytes for layout in request.images)}
        return replace(request, images=(), image_embeds=embeds, timings=timings)

    def finalize(self):
        super().finalize()
        self.pulls.shutdown(wait=True)
