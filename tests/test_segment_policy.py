"""The segment policy has one C++/CUDA home (csrc/gdn_segment_policy.h) and one Python home
(flashqla_tune/segment_policy.py). A small host program built from the header prints its limits,
bucket and segment counts over a sweep of chunk counts and segment tables, and they must equal
the Python functions'; the same program's answers computed in a kernel (the header's device
code) must too, on the H200. The CP kernels (gdn_cp.cuh), the library's launch checks
(gdn_fwd_host.cuh) and the C++ host path (gdn_torch_host.cpp) call the header's functions, so
the sweep reaches their rules too; the source checks below fail if any of them grows a copy."""
from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flashqla_tune import environment, segment_policy as P

from toolchain import needs_nvcc

HEADER = "gdn_segment_policy.h"
CSRC = Path(__file__).resolve().parents[1] / "csrc"

# Reads segment tables and chunk counts from stdin, answers one line per (table, chunks) and per
# (chunks, length) pair, through the header's functions only.
PROGRAM = r"""
#include "gdn_segment_policy.h"
#include <stdio.h>
int main() {
  printf("%d %lld %lld %lld\n", fqt::kSegmentBuckets, (long long)fqt::kMaxSequences,
         (long long)fqt::kMaxSegments, (long long)fqt::kMaxTokens);
  int tables = 0, counts = 0, pairs = 0;
  if (scanf("%d %d %d", &tables, &counts, &pairs) != 3) return 1;
  static int32_t table[fqt::kSegmentBuckets];
  static long long chunks[4096];
  if (counts > 4096) return 1;
  for (int i = 0; i < counts; ++i) if (scanf("%lld", &chunks[i]) != 1) return 1;
  for (int t = 0; t < tables; ++t) {
    for (int b = 0; b < fqt::kSegmentBuckets; ++b) if (scanf("%d", &table[b]) != 1) return 1;
    for (int i = 0; i < counts; ++i) {
      const int64_t c = chunks[i];
      const int64_t length = fqt::segment_chunks_for(table, c);
      printf("%d %lld %lld\n", fqt::bucket_of_chunks(c), (long long)length, (long long)fqt::segments_of(c, length));
    }
  }
  for (int i = 0; i < pairs; ++i) {
    long long c = 0, length = 0;
    if (scanf("%lld %lld", &c, &length) != 2) return 1;
    printf("%lld\n", (long long)fqt::segments_of(c, length));
  }
  return 0;
}
"""


# The same answers computed on the GPU, through the header's device code (its __CUDA_ARCH__
# branches, which the CP kernels run): the host reads stdin as above, the kernel answers, the host
# prints.
DEVICE_PROGRAM = r"""
#include "gdn_segment_policy.h"
#include <stdio.h>
#include <cuda_runtime.h>
__global__ void answer(const int32_t* tables, int n_tables, const long long* chunks, int n_counts,
                       const long long* pairs, int n_pairs, long long* out) {
  const int total = n_tables * n_counts + n_pairs;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    if (i < n_tables * n_counts) {
      const int32_t* table = tables + (i / n_counts) * fqt::kSegmentBuckets;
      const int64_t c = chunks[i % n_counts];
      const int64_t length = fqt::segment_chunks_for(table, c);
      out[3 * i] = fqt::bucket_of_chunks(c);
      out[3 * i + 1] = length;
      out[3 * i + 2] = fqt::segments_of(c, length);
    } else {
      const int j = i - n_tables * n_counts;
      out[3 * i] = fqt::segments_of(pairs[2 * j], pairs[2 * j + 1]);
    }
  }
}
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(e)); return 2; } } while (0)
int main() {
  printf("%d %lld %lld %lld\n", fqt::kSegmentBuckets, (long long)fqt::kMaxSequences,
         (long long)fqt::kMaxSegments, (long long)fqt::kMaxTokens);
  int tables = 0, counts = 0, pairs = 0;
  if (scanf("%d %d %d", &tables, &counts, &pairs) != 3 || counts > 4096 || tables > 64 || pairs > 4096) return 1;
  static long long chunks[4096], pair_values[2 * 4096], out[3 * (64 * 4096 + 4096)];
  static int32_t table_values[64 * fqt::kSegmentBuckets];
  for (int i = 0; i < counts; ++i) if (scanf("%lld", &chunks[i]) != 1) return 1;
  for (int i = 0; i < tables * fqt::kSegmentBuckets; ++i) if (scanf("%d", &table_values[i]) != 1) return 1;
  for (int i = 0; i < 2 * pairs; ++i) if (scanf("%lld", &pair_values[i]) != 1) return 1;
  int32_t* d_tables; long long *d_chunks, *d_pairs, *d_out;
  const int total = tables * counts + pairs;
  CHECK(cudaMalloc(&d_tables, sizeof(table_values)));
  CHECK(cudaMalloc(&d_chunks, sizeof(chunks)));
  CHECK(cudaMalloc(&d_pairs, sizeof(pair_values)));
  CHECK(cudaMalloc(&d_out, sizeof(long long) * 3 * total));
  CHECK(cudaMemcpy(d_tables, table_values, sizeof(table_values), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_chunks, chunks, sizeof(chunks), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_pairs, pair_values, sizeof(pair_values), cudaMemcpyHostToDevice));
  answer<<<64, 256>>>(d_tables, tables, d_chunks, counts, d_pairs, pairs, d_out);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(out, d_out, sizeof(long long) * 3 * total, cudaMemcpyDeviceToHost));
  for (int i = 0; i < tables * counts; ++i) printf("%lld %lld %lld\n", out[3 * i], out[3 * i + 1], out[3 * i + 2]);
  for (int i = tables * counts; i < total; ++i) printf("%lld\n", out[3 * i]);
  return 0;
}
"""


def chunk_counts() -> list[int]:
    counts = set(range(0, 300))
    for e in range(1, 45):
        counts.update((2 ** e - 1, 2 ** e, 2 ** e + 1))
    return sorted(counts)


def segment_tables() -> list[list[int]]:
    rng = random.Random(7)
    values = [0, 0, 1, 2, 3, 4, 8, 16, 32, 100, 2 ** 20, 2 ** 31 - 1]
    tables = [[0] * P.SEGMENT_BUCKETS, list(range(P.SEGMENT_BUCKETS)), [0] * 6 + [16] * 26]
    tables += [[rng.choice(values) for _ in range(P.SEGMENT_BUCKETS)] for _ in range(12)]
    return tables


def length_pairs() -> list[tuple[int, int]]:
    return [(c, length) for c in list(range(0, 70)) + [2 ** 20, 2 ** 40 + 3]
            for length in (0, 1, 2, 3, 7, 32, 64, 65, 2 ** 20, 2 ** 31 - 1)]


def python_answers(tables, counts, pairs) -> list[str]:
    lines = [f"{P.SEGMENT_BUCKETS} {P.MAX_SEQUENCES} {P.MAX_SEGMENTS} {P.MAX_TOKENS}"]
    for table in tables:
        for c in counts:
            b = P.bucket_of_chunks(c)
            lines.append(f"{b} {table[b]} {P.segments_of(c, table[b])}")
    lines += [str(P.segments_of(c, length)) for c, length in pairs]
    return lines


def run_program(compile_command: list[str], where: Path, tables, counts, pairs) -> list[str]:
    subprocess.run(compile_command, check=True, cwd=where, capture_output=True, text=True)
    stdin = [f"{len(tables)} {len(counts)} {len(pairs)}", " ".join(map(str, counts))]
    stdin += [" ".join(map(str, t)) for t in tables]
    stdin += [f"{c} {length}" for c, length in pairs]
    out = subprocess.run([str(where / "policy")], input="\n".join(stdin) + "\n", check=True, capture_output=True,
                         text=True).stdout
    return out.splitlines()


def _nvcc() -> str:
    return str(environment.find_nvcc())  # as the kernel build finds it (PATH, CUDA_HOME or the wheel)


COMPILERS = {
    "g++": lambda src: ["g++", "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o", "policy"],
    # nvcc reads the header with its CUDA qualifiers (the kernels' view of it); host code only, no GPU
    "nvcc": lambda src: [_nvcc(), "-x", "cu", "-std=c++17", "-O2", f"-I{CSRC}", str(src), "-o", "policy"],
}
# the kernels' target: the device program runs the header's device code on an sm_90 GPU
DEVICE_COMPILE = lambda src: [_nvcc(), "-x", "cu", "-std=c++17", "-O2", "-arch=sm_90a", f"-I{CSRC}", str(src), "-o",
                              "policy"]


@pytest.mark.parametrize("compiler", [pytest.param("g++"), pytest.param("nvcc", marks=needs_nvcc)])
def test_the_header_and_the_python_policy_agree(compiler, tmp_path):
    if compiler == "g++" and shutil.which(compiler) is None:
        pytest.skip("needs g++")
    src = tmp_path / "policy.cpp"
    src.write_text(PROGRAM)
    tables, counts, pairs = segment_tables(), chunk_counts(), length_pairs()
    got = run_program(COMPILERS[compiler](src), tmp_path, tables, counts, pairs)
    want = python_answers(tables, counts, pairs)
    assert len(got) == len(want)
    mismatches = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatches, f"{len(mismatches)} answers differ, first (line, header, python): {mismatches[:5]}"


@needs_nvcc
def test_the_device_program_builds(tmp_path):
    src = tmp_path / "policy.cu"
    src.write_text(DEVICE_PROGRAM)
    subprocess.run(DEVICE_COMPILE(src), check=True, cwd=tmp_path, capture_output=True, text=True)
    assert (tmp_path / "policy").is_file()


@pytest.mark.gpu
@needs_nvcc
def test_the_header_on_the_device_and_the_python_policy_agree(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    src = tmp_path / "policy.cu"
    src.write_text(DEVICE_PROGRAM)
    tables, counts, pairs = segment_tables(), chunk_counts(), length_pairs()
    got = run_program(DEVICE_COMPILE(src), tmp_path, tables, counts, pairs)
    want = python_answers(tables, counts, pairs)
    assert len(got) == len(want)
    mismatches = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatches, f"{len(mismatches)} device answers differ, first (line, device, python): {mismatches[:5]}"


def test_the_sweep_reaches_every_bucket_and_both_segment_cases():
    counts = chunk_counts()
    assert {P.bucket_of_chunks(c) for c in counts} == set(range(P.SEGMENT_BUCKETS))
    assert {P.segments_of(c, length) > 1 for c, length in length_pairs()} == {True, False}


def _code(text: str) -> str:
    """C++ source without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


USERS = ("gdn_cp.cuh", "gdn_fwd_host.cuh", "gdn_torch_host.cpp")


@pytest.mark.parametrize("name", USERS)
def test_the_policy_users_include_the_header_and_keep_no_copy(name):
    code = _code((CSRC / name).read_text())
    assert f'#include "{HEADER}"' in code
    assert "65535" not in code
    for definition in (r"\bkSegmentBuckets\s*=", r"\bkMaxSegments\s*=", r"\bkMaxSequences\s*=", r"\bkMaxTokens\s*=",
                       r"\b(?:int|int64_t)\s+(?:segments_of|segment_chunks_for|bucket_of_chunks)\s*\("):
        assert not re.search(definition, code), f"{name} defines its own {definition}"


def test_no_other_source_carries_the_limits():
    """The 65535 grid limit and the bucket count appear in no C++/CUDA source or template but the
    header, and in no package module but segment_policy.py."""
    package = Path(P.__file__).parent
    templates = package.parent / "templates"
    sources = [p for p in CSRC.iterdir() if p.suffix in (".h", ".cuh", ".cpp", ".cu") and p.name != HEADER]
    if templates.is_dir():
        sources += list(templates.glob("*.j2"))
    for path in sources:
        code = _code(path.read_text())
        assert "65535" not in code and not re.search(r"kSegmentBuckets\s*=", code), path
    for path in package.rglob("*.py"):
        if path.name == "segment_policy.py":
            continue
        text = path.read_text()
        assert "65535" not in text and not re.search(r"^SEGMENT_BUCKETS\s*=", text, flags=re.M), path
