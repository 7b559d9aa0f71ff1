"""Front doors in front of the model repository that speak other protocols than Triton's (``frontend.openai``)."""
