"""Triton Python-backend entry point of `prefill`: the model class lives in backend.models.prefill."""
from backend.models.prefill import TritonPythonModel  # noqa: F401
