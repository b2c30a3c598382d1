"""Package data: the CUDA/C++ headers the templates include (a regular package so importlib.resources finds it)."""
