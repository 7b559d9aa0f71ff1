"""Triton Python-backend entry point of `pd`: the model class lives in backend.triton.models.pd."""
from backend.triton.models.pd import TritonPythonModel  # noqa: F401
