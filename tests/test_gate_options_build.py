"""The in-kernel gate and beta options compile into the prep kernel (and its CP guard) only.

One parallel nvcc run per pytest run (a module fixture, into a temporary kernel cache) builds a
default plan and the same plan with every option on; the checks read ptxas's report and the SASS:
no spills in the prep kernel and no new ones anywhere, the option's prep kernel does the extra
exponentials and logarithms, and every other kernel (the sequential kernel in all its forms, the
CP chain and segments kernels) is the same code instruction for instruction, since they read only
what the prep wrote.
"""
from __future__ import annotations

import re

import pytest

from flashqla_tune import cache, sass
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

from toolchain import needs_nvcc

pytestmark = [pytest.mark.slow, needs_nvcc]

PLAIN = default_plan(GDNSpec(2, 8))
GATED = default_plan(GDNSpec(2, 8, gate_in_kernel=True, beta_sigmoid_in_kernel=True, allow_neg_eigval=True))
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate_cache")
    plain, gated = cache.get_kernels([PLAIN, GATED], root=root)
    return plain, gated


def _functions(library) -> dict[str, str]:
    """SASS text per function (mangled name -> instructions, addresses included)."""
    out, name = {}, None
    for line in sass.sass_text(library).splitlines():
        found = re.match(r"^\s*Function\s*:\s*(\S+)", line)
        if found:
            name = found.group(1)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return {n: "\n".join(lines) for n, lines in out.items()}


def test_the_options_add_no_spills(built):
    """The prep kernel spills in neither plan; every kernel keeps the plain plan's registers and spills."""
    plain, gated = ({name: info for name, info in entry.resources.items() if info.get("entry")} for entry in built)
    prep = {name for name in {**plain, **gated} if "gdn_prep_kernel" in name}
    for name in prep:
        info = {**plain, **gated}[name]
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (name, info)
    assert sorted(set(plain) - prep) == sorted(set(gated) - prep)
    for name in set(plain) - prep:
        for what in ("registers", "spill_stores", "spill_loads"):
            assert plain[name][what] == gated[name][what], (name, what, plain[name], gated[name])


def test_only_the_prep_kernel_changes(built):
    plain, gated = (_functions(entry.so_path) for entry in built)
    prep_plain = [n for n in plain if "gdn_prep_kernel" in n]
    prep_gated = [n for n in gated if "gdn_prep_kernel" in n]
    assert len(prep_plain) == len(prep_gated) == 1
    assert "GateOptionsILb0ELb0ELb0E" in prep_plain[0] and "GateOptionsILb1ELb1ELb1E" in prep_gated[0]
    others = sorted(n for n in plain if "gdn_prep_kernel" not in n)
    assert others == sorted(n for n in gated if "gdn_prep_kernel" not in n) and len(others) >= 5
    for name in others:
        assert plain[name] == gated[name], f"{name} differs between {PLAIN.name} and {GATED.name}"
    mufu = [sass.parse_sass(sass.sass_text(e.so_path)).count("MUFU", p) for e, p in zip(built, (prep_plain[0],
                                                                                             prep_gated[0]))]
    assert mufu[1] > mufu[0], mufu   # exp and log of softplus, exp of A_log and of the sigmoid
    assert _ADDRESS.sub("", plain[prep_plain[0]]) != _ADDRESS.sub("", gated[prep_gated[0]])
