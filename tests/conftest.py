"""Fixtures several test modules share."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_offered_backward_libraries(monkeypatch):
    """A pack loaded by one test offers its backward libraries process-wide (FakeBinary bytes in the
    pack doubles), and a test may open or register one: every test starts with a fresh table of each
    kind (chain, prep, chunk) already imported; nothing is imported here. The modules look LIBRARIES
    up at call time."""
    for name in ("chain_kernels", "prep_kernels", "chunk_kernels"):
        module = sys.modules.get(f"flashqla_tune.backward.{name}")
        if module is not None:
            table = sys.modules["flashqla_tune.backward.kernel_library"].LibraryTable
            monkeypatch.setattr(module, "LIBRARIES", table(module.KIND))


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """One kernel cache (a FLASHQLA_TUNE_CACHE folder) for the tests that build with nvcc, so a
    library two of them need (the backward's three, each a minute or more on two cores) is compiled
    once per run; entries are content-addressed, so sharing them changes no result."""
    return tmp_path_factory.mktemp("fqt-cache")


@pytest.fixture(scope="session")
def shipped_pack(tmp_path_factory):
    """An untuned pack of the shipped model, built once per pytest run and shared by the GPU modules."""
    pytest.importorskip("transformers")  # the build calibrates the model through its own layers
    from flashqla_tune.calibrate.default_model import default_model_path
    from flashqla_tune.pack_build import build_pack

    out = tmp_path_factory.mktemp("pack") / "default_pack"
    build_pack(default_model_path(), out, tune=False, progress=False)
    return out
