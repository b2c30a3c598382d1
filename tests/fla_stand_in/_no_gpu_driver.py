"""What a Triton kernel does when it is launched on a machine without a GPU driver."""


def no_driver(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{name}: 0 active drivers ([]). There should only be one.")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel
