"""Fixtures several test modules share."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_offered_chain_library(monkeypatch):
    """A pack loaded by one test offers its backward chain library process-wide (FakeBinary bytes in
    the pack doubles): every test starts with none offered."""
    chain_kernels = sys.modules.get("flashqla_tune.backward.chain_kernels")
    if chain_kernels is not None:
        monkeypatch.setattr(chain_kernels, "_offered", {})


@pytest.fixture(scope="session")
def shipped_pack(tmp_path_factory):
    """An untuned pack of the shipped model, built once per pytest run and shared by the GPU modules."""
    pytest.importorskip("transformers")  # the build calibrates the model through its own layers
    from flashqla_tune.calibrate.default_model import default_model_path
    from flashqla_tune.pack_build import build_pack

    out = tmp_path_factory.mktemp("pack") / "default_pack"
    build_pack(default_model_path(), out, tune=False, progress=False)
    return out
