"""Triton Python-backend entry point of `llm`: the model class lives in backend.triton.models.llm."""
from backend.triton.models.llm import TritonPythonModel  # noqa: F401
