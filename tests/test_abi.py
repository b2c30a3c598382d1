"""flashqla_tune/abi.py mirrors csrc/gdn_abi.h exactly; loading needs no torch C++ extension."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys

import pytest

from flashqla_tune import abi
from flashqla_tune.render import ABI_VERSION, csrc_dir

HEADER = csrc_dir() / "gdn_abi.h"
C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def header_fields() -> list[tuple[str, str]]:
    """(name, C type) of FqtGdnFwdArgs's fields, in order, from the header text."""
    text = HEADER.read_text()
    body = re.search(r"typedef struct FqtGdnFwdArgs \{(.*?)\} FqtGdnFwdArgs;", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(?:const\s+)?([A-Za-z_]\w*)\s*(\*?)\s*([A-Za-z_]\w*)", " ".join(decl.split()))
        assert m, f"cannot parse field declaration {decl!r}"
        fields.append((m.group(3), m.group(1) + m.group(2)))
    return fields


def test_struct_fields_match_the_header():
    fields = header_fields()
    mirror = abi.FqtGdnFwdArgs._fields_
    assert [n for n, _ in fields] == [n for n, _ in mirror]
    for (name, ctype), (_, pytype) in zip(fields, mirror):
        expected = ctypes.c_void_p if ctype.endswith("*") else C_TYPES[ctype]
        assert pytype is expected, f"field {name}: header says {ctype}, abi.py has {pytype.__name__}"


def test_abi_version_matches_the_header():
    version = int(re.search(r"#define FQT_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
    assert version == abi.ABI_VERSION == ABI_VERSION


def test_exported_functions_match_the_header():
    text = HEADER.read_text()
    declared = re.findall(r"^[\w\s\*]*?\b(fqt_\w+)\(", text, re.M)
    assert tuple(declared) == abi.SYMBOLS


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a host C compiler")
def test_offsets_and_size_agree_with_the_c_compiler(tmp_path):
    names = [n for n, _ in abi.FqtGdnFwdArgs._fields_]
    prints = "\n".join(f'  printf("{n} %zu\\n", offsetof(FqtGdnFwdArgs, {n}));' for n in names)
    (tmp_path / "probe.c").write_text(
        f'#include <stddef.h>\n#include <stdio.h>\n#include "gdn_abi.h"\n'
        f'int main(void) {{\n{prints}\n  printf("sizeof %zu\\n", sizeof(FqtGdnFwdArgs));\n  return 0;\n}}\n')
    subprocess.run(["cc", "-I", str(csrc_dir()), "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True).stdout
    measured = dict(line.split() for line in out.splitlines())
    for name in names:
        assert int(measured[name]) == getattr(abi.FqtGdnFwdArgs, name).offset, name
    assert int(measured["sizeof"]) == ctypes.sizeof(abi.FqtGdnFwdArgs)


def test_loader_import_builds_nothing_and_skips_cpp_extension():
    code = ("import sys, flashqla_tune.loader, flashqla_tune.cache, flashqla_tune.abi; "
            "print('torch.utils.cpp_extension' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
