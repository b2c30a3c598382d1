"""The ctypes mirrors of the backward libraries' argument structs against the C structs themselves.

Each library checks at load time that its struct has the size the Python side expects; a field
swapped for another of the same size (two int32 dtype codes, two pointers) would pass that and feed
the kernel the wrong value. Here a host program compiled by nvcc prints every field's offset and
size as the C compiler lays it out (offsetof, sizeof), for the chain, prep and per-chunk gradient
kernels' structs, and each must be the ctypes field of the same name at the same offset and size.
"""
from __future__ import annotations

import ctypes

import pytest

from flashqla_tune.backward import chain_kernels, chunk_kernels, prep_kernels

from toolchain import needs_nvcc, run_host_program

# (host header, C struct, ctypes mirror)
STRUCTS = [
    ("gdn_bwd_chain_host.cuh", "FqtBwdChainArgs", chain_kernels.ChainArgs),
    ("gdn_bwd_prep_host.cuh", "FqtBwdPrepArgs", prep_kernels.PrepArgs),
    ("gdn_bwd_chunk_host.cuh", "FqtBwdChunkArgs", chunk_kernels.ChunkArgs),
]


def layout_program() -> str:
    """A host program printing `struct field offset size` per ctypes field and `struct - sizeof 0`."""
    lines = ['#include "gdn_driver_entry.cuh"', *(f'#include "{header}"' for header, _, _ in STRUCTS),
             "#include <cstddef>", "#include <cstdio>", "int main() {"]
    for _, struct, mirror in STRUCTS:
        for name, _ in mirror._fields_:
            lines.append(f'  std::printf("{struct} {name} %zu %zu\\n", offsetof({struct}, {name}), '
                         f'sizeof((({struct}*)nullptr)->{name}));')
        lines.append(f'  std::printf("{struct} - %zu 0\\n", sizeof({struct}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@needs_nvcc
def test_ctypes_mirrors_lay_out_every_field_as_the_c_structs(tmp_path):
    seen = {}
    for line in run_host_program(layout_program(), tmp_path, "abi_layout").splitlines():
        struct, name, offset, size = line.split()
        seen[struct, name] = (int(offset), int(size))
    for _, struct, mirror in STRUCTS:
        assert seen[struct, "-"][0] == ctypes.sizeof(mirror), struct
        for name, _ in mirror._fields_:
            field = getattr(mirror, name)
            assert seen[struct, name] == (field.offset, field.size), (
                f"{struct}.{name}: C offset and size {seen[struct, name]}, ctypes {(field.offset, field.size)}")
