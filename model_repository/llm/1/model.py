"""Triton Python-backend entry point of `llm`: the model class lives in backend.models.llm."""
from backend.models.llm import TritonPythonModel  # noqa: F401
