"""Triton Python-backend entry point of `pd`: the model class lives in backend.models.pd."""
from backend.models.pd import TritonPythonModel  # noqa: F401
