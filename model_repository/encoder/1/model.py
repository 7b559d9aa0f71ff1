"""Triton Python-backend entry point of `encoder`: the model class lives in backend.triton.models.encoder."""
from backend.triton.models.encoder import TritonPythonModel  # noqa: F401
