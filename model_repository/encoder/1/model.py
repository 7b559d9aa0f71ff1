"""Triton Python-backend entry point of `encoder`: the model class lives in backend.models.encoder."""
from backend.models.encoder import TritonPythonModel  # noqa: F401
