"""Test-only GPU consumer: pull the layout's embeddings into this instance's GPU (the project's consumer,
CUDA IPC on one host) and compare them with transformers' tower run here on the same image."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.engine.host import prepare_process


class TritonPythonModel:
    def initialize(self, args):
        prepare_process()
        import torch
        from backend.encode.encoder import VisionEncoder
        from backend.transfer.consumer import EmbeddingConsumer

        config = json.loads(args["model_config"])
        self.device = f"cuda:{args['model_instance_device_id']}"
        model_dir = config["parameters"]["model"]["string_value"]
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.reference = VisionEncoder.load(model_dir, device=self.device, impl="transformers")
        self.consumer = EmbeddingConsumer(role="check", device=self.device)

    def execute(self, requests):
        from backend.protocol.layout import LayoutMetadata
        from backend.request.image import decode_image
        from backend.request.media import MediaLimits

        responses = []
        for request in requests:
            image = bytes(pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)[0])
            doc = pb_utils.get_input_tensor_by_name(request, "layout").as_numpy().reshape(-1)[0]
            layout = LayoutMetadata.from_json(doc.decode() if isinstance(doc, bytes) else doc, "layout")
            before = dict(self.consumer.paths)
            pulled = self.consumer.pull(layout)
            path = next(p for p, n in self.consumer.paths.items() if n != before.get(p, 0))
            expected = self.reference.encode([decode_image(image, "image", MediaLimits())])[0].embeddings
            diff = float((pulled.float() - expected.float()).abs().max())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("max_abs_diff", np.array([diff], dtype=np.float32)),
                pb_utils.Tensor("path", np.array([path.encode()], dtype=np.object_)),
                pb_utils.Tensor("device", np.array([str(pulled.device).encode()], dtype=np.object_))]))
        return responses

    def finalize(self):
        self.consumer.close()
