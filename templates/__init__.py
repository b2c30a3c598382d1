"""Package data: the Jinja CUDA templates (a regular package so importlib.resources finds it)."""
