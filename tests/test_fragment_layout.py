"""The layout facts the register-resident chain of csrc/gdn_fwd_mainloop.cuh rests on, checked with
CuTe itself in a host-only nvcc probe (a new CUTLASS that changed them would break the kernel
silently, so this test breaks first):

- element e of a 64 x N wgmma accumulator (the kernel's MmaTok with N = 64 and MmaState with
  N = 128) and element e of the register A fragment of a 64 x 16k operand have the same (row, col),
  which is what lets `to_operand` turn an accumulator into the next wgmma's A operand;
- that coordinate is (row0 + 8 ((e / 2) % 2), col0 + e % 2 + 8 (e / 4)), with row0 = 16 (warp) +
  lane / 4 and col0 = 2 (lane % 4): `column_slot` and the ldmatrix.trans tile order assume it;
- the prep kernel's (csrc/gdn_prep.cuh) 64 x 64 accumulator holds neighbouring columns in values
  e, e + 1 (e even), which its paired fp32 tile stores assume.
"""
from __future__ import annotations

import pytest

from toolchain import have_toolchain, run_host_program

PROBE = r'''
#include <cstdio>
#include "gdn_fwd_mainloop.cuh"
using namespace cute;
using Cfg = fqt::FwdConfig<cutlass::bfloat16_t, 2, 8, 128, 128, 64, 2, false, 40, 232>;

template <class Mma, int N>
int check(int tid) {
  Mma mma;
  auto thr = mma.get_thread_slice(tid);
  auto acc = thr.partition_C(make_identity_tensor(Shape<_64, Int<N>>{}));
  auto frag = thr.partition_A(make_identity_tensor(Shape<_64, Int<N>>{}));
  const int row0 = 16 * (tid / 32) + (tid % 32) / 4, col0 = 2 * (tid % 4);
  int bad = int(size(acc)) != int(size(frag));
  for (int e = 0; e < int(size(acc)); ++e) {
    const int row = get<0>(acc(e)), col = get<1>(acc(e));
    bad += row != get<0>(frag(e)) || col != get<1>(frag(e));
    bad += row != row0 + 8 * ((e / 2) % 2) || col != col0 + e % 2 + 8 * (e / 4);
    if (N == 64) {  // decay[column_slot(e)] is loaded for column col0 + 8 (j / 2) + j % 2
      const int j = fqt::column_slot(e);
      bad += col != col0 + 8 * (j / 2) + j % 2;
    }
  }
  return bad;
}

int main() {
  int bad = 0;
  for (int tid = 0; tid < 128; ++tid) {
    bad += check<Cfg::MmaTok, 64>(tid);
    bad += check<Cfg::MmaState, 128>(tid);
  }
  std::printf("%d\n", bad);
}
'''


def run_probe(source: str, where) -> list[str]:
    """Build a host program against csrc/ and CUTLASS with nvcc and run it: its stdout's words."""
    if not have_toolchain():   # CI has both; a bare machine reports why it skipped
        pytest.skip("no nvcc or CUTLASS headers")
    return run_host_program(source, where).split()


@pytest.mark.slow
def test_accumulator_and_register_operand_layouts_agree(tmp_path):
    out = run_probe(PROBE, tmp_path)
    assert out == ["0"], f"{out[0]} coordinate mismatches: the kernel's fragment assumptions no longer hold"


PREP_PROBE = r'''
#include <cstdio>
#include "gdn_prep.cuh"
using namespace cute;

// The prep stores its fp32 K K^T and Q K^T accumulators two columns at a time (csrc/gdn_prep.cuh, store_tile):
// values e and e + 1 must be (r, c) and (r, c + 1) with c even, and the 128 threads must cover
// the 64 x 64 tile once.
template <int Threads>
int check() {
  using Mma = typename fqt::PrepConfig<cutlass::bfloat16_t, 16, 128, Threads>::Mma;
  int bad = 0, seen[64][64] = {};
  for (int tid = 0; tid < 128; ++tid) {
    Mma mma;
    auto acc = mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    for (int e = 0; e < int(size(acc)); e += 2) {
      const int row = get<0>(acc(e)), col = get<1>(acc(e));
      bad += col % 2 != 0 || get<0>(acc(e + 1)) != row || get<1>(acc(e + 1)) != col + 1;
      seen[row][col] += 1;
      seen[get<0>(acc(e + 1))][get<1>(acc(e + 1))] += 1;
    }
  }
  for (auto& row : seen)
    for (int n : row) bad += n != 1;
  return bad;
}

int main() { std::printf("%d\n", check<128>() + check<256>()); }
'''


@pytest.mark.slow
def test_prep_accumulator_pairs_are_neighbouring_columns(tmp_path):
    out = run_probe(PREP_PROBE, tmp_path)
    assert out == ["0"], f"{out[0]} mismatches: the prep's paired accumulator stores would be wrong"
