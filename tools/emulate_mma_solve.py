"""The prep's tensor-core A0 solve for one v-head (csrc/gdn_prep_solve_mma.cuh) emulated on the
CPU lane by lane: the same shared-memory tile (kk, 64 rows of 68 floats, X into its upper
triangle), the same per-thread index arithmetic, and each mma.sync m16n8k8 built from the 32
lanes' fragment registers as the PTX ISA lays them out (TF32 operands truncated, the low 13 bits
cleared, as the kernel takes them; fp32 accumulation). A wrong fragment index or a wrong k order
shows as a large error against the float64 inverse: the check to run before a changed solve goes
to the H200. With --rna the TF32 parts are rounded to nearest, ties away (cvt.rna.tf32.f32), the
costlier split the kernel does not take. With --separate-x, X goes into a NaN-filled tile of its
own, as when several v-heads solve at once (solve_into): every X read must then find a cell an
earlier stage wrote. Prints the errors and the checks' verdicts (standard output; exit status 1
on a failed check).

    python3 tools/emulate_mma_solve.py [--rna] [--separate-x]
"""
from __future__ import annotations

import sys

import numpy as np

PAD = 68


TRUNCATE = True  # --rna: False, rounding to nearest instead of the kernel's truncation
SEPARATE_X = False  # --separate-x: X into a tile of its own (several v-heads solved at once)


def tf32(x: np.float32) -> np.float32:
    """Keep 10 mantissa bits: clear the 13 low bits (TRUNCATE), else cvt.rna.tf32.f32's round to
    nearest with ties away from zero."""
    bits = np.array([x], np.float32).view(np.uint32)[0]
    bits = np.uint32((int(bits) + (0 if TRUNCATE else 0x1000)) & 0xFFFFE000)
    return np.array([bits], np.uint32).view(np.float32)[0]


class Tiles:
    """The shared-memory tiles as the kernel's accessors see them: L from K K^T's lower triangle,
    X into `xt` (K K^T itself, or with --separate-x a tile of its own filled with NaN first, as
    solve_into gives the heads solved beside the first). It records which cells a stage reads, so each stage can be
    checked to write only cells none of its threads read, and to read X only where it was written."""

    def __init__(self, kk: np.ndarray, beta: np.ndarray, xt: np.ndarray | None = None):
        self.kk, self.beta = kk, beta  # kk: flat float32 [64 * PAD]
        self.xt = kk if xt is None else xt
        self.reads: set[int] = set()
        self.x_reads: set[int] = set()

    def read(self, index):
        self.reads.add(index)
        return self.kk[index]

    def l(self, i, j):
        return np.float32(self.beta[i] * self.read(i * PAD + j))

    def x(self, i, j):
        if i > j:
            self.reads.add(j * PAD + i)
            self.x_reads.add(j * PAD + i)
            return self.xt[j * PAD + i]
        return np.float32(1) if i == j else np.float32(0)

    def set_x(self, i, j, v):
        self.xt[j * PAD + i] = v


def mma(d, a, b):
    """d[lane] += A B over the warp: a[lane] = 4 values, b[lane] = 2 values (one precision part)."""
    A = np.zeros((16, 8)); B = np.zeros((8, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        A[g, q], A[g + 8, q], A[g, q + 4], A[g + 8, q + 4] = (float(v) for v in a[lane])
        B[q, g], B[q + 4, g] = (float(v) for v in b[lane])
    C = A @ B
    for lane in range(32):
        g, q = lane // 4, lane % 4
        add = (C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1])
        d[lane] = [np.float32(d[lane][e] + add[e]) for e in range(4)]


def mma_3xtf32(d, a, b):
    ah = [[tf32(v) for v in a[lane]] for lane in range(32)]
    al = [[tf32(np.float32(v - h)) for v, h in zip(a[lane], ah[lane])] for lane in range(32)]
    bh = [[tf32(v) for v in b[lane]] for lane in range(32)]
    bl = [[tf32(np.float32(v - h)) for v, h in zip(b[lane], bh[lane])] for lane in range(32)]
    mma(d, al, bh)
    mma(d, ah, bl)
    mma(d, ah, bh)


def diagonal_blocks(s: Tiles):
    writes = []
    for t in range(64):
        a0, c = (t // 16) * 16, t % 16
        x = [np.float32(0)] * 16
        for r in range(16):
            part = [np.float32(0), np.float32(0)]
            for m in range(r):
                part[m & 1] = np.float32(part[m & 1] + s.read((a0 + r) * PAD + a0 + m) * x[m])
            x[r] = np.float32(0) if r < c else (np.float32(1) if r == c else np.float32(-s.beta[a0 + r] * (part[0] + part[1])))
        for r in range(1, 16):
            if r > c:
                writes.append((a0 + r, a0 + c, x[r]))
    return writes


def offdiagonal_block(s: Tiles, ra: int, cb: int, w: int, M: int):
    """One warp (all 32 lanes at once) of csrc/gdn_prep_solve_mma.cuh offdiagonal_block."""
    N = 2 * M
    i0 = cb + 16 * w
    tt = [[[np.float32(0)] * 4 for _ in range(32)] for _ in range(N)]
    for ks in range(N):
        if 8 * ks + 7 < 16 * w:
            continue
        a = []
        for lane in range(32):
            g, q = lane // 4, lane % 4
            k = cb + 8 * ks + q
            a.append([s.x(k, i0 + g), s.x(k, i0 + g + 8), s.x(k + 4, i0 + g), s.x(k + 4, i0 + g + 8)])
        for n in range(N):
            b = []
            for lane in range(32):
                g, q = lane // 4, lane % 4
                k = cb + 8 * ks + q
                b.append([s.l(ra + 8 * n + g, k), s.l(ra + 8 * n + g, k + 4)])
            mma_3xtf32(tt[n], a, b)
    out = [[[np.float32(0)] * 4 for _ in range(32)] for _ in range(N)]
    for ks in range(N):
        a = [[tt[ks][lane][0], tt[ks][lane][2], tt[ks][lane][1], tt[ks][lane][3]] for lane in range(32)]
        for n in range(N):
            if n < ks:
                continue
            b = []
            for lane in range(32):
                g, q = lane // 4, lane % 4
                k = ra + 8 * ks + 2 * q
                b.append([s.x(ra + 8 * n + g, k), s.x(ra + 8 * n + g, k + 1)])
            mma_3xtf32(out[n], a, b)
    writes = []
    for n in range(N):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for e in range(4):
                writes.append((ra + 8 * n + 2 * q + (e & 1), i0 + g + 8 * (e >> 1), np.float32(-out[n][lane][e])))
    return writes


def solve(kk: np.ndarray, beta: np.ndarray) -> np.ndarray:
    s = Tiles(kk, beta, np.full_like(kk, np.nan) if SEPARATE_X else None)
    stages = [lambda: diagonal_blocks(s)]
    for blocks in ([(16, 0, 0, 1), (48, 32, 0, 1)], [(32, 0, 0, 2), (32, 0, 1, 2)]):
        stages.append(lambda blocks=blocks: [wr for ra, cb, w, M in blocks for wr in offdiagonal_block(s, ra, cb, w, M)])
    written: set[int] = set()
    for number, stage in enumerate(stages):
        # a stage's threads all compute from the tile as the barrier left it, then their stores land
        s.reads, s.x_reads = set(), set()
        writes = stage()
        cells = {j * PAD + i for i, j, _ in writes}
        assert not cells & s.reads, f"stage {number} reads {len(cells & s.reads)} cells it writes"
        assert s.x_reads <= written, f"stage {number} reads {len(s.x_reads - written)} cells of X no stage wrote"
        assert len(cells) == len(writes) and not cells & written, f"stage {number} writes a cell twice"
        written |= cells
        for i, j, v in writes:
            s.set_x(i, j, v)
    assert written == {j * PAD + i for j in range(64) for i in range(j + 1, 64)}, "X's lower part is not all written"
    X = np.zeros((64, 64), np.float32)
    for c in range(64):
        for i in range(c, 64):
            X[i, c] = s.x(i, c)
    return X


def column_solve(kkt: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The kernel's other solve (one column per thread, fp32): the error bar for this one."""
    X = np.zeros((64, 64), np.float32)
    for c in range(64):
        x = np.zeros(64, np.float32)
        x[c] = 1
        for i in range(c + 1, 64):
            x[i] = np.float32(-beta[i] * np.dot(kkt[i, :i], x[:i]))
        X[:, c] = x
    return X


def main() -> int:
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(5):
        k = rng.standard_normal((64, 128))
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        beta = rng.uniform(0, 2 if trial == 2 else 1, 64).astype(np.float32)
        if trial == 1:  # a tail chunk: rows past 40 are zero (k and beta), as the kernel sees them
            k[40:] = 0
            beta[40:] = 0
        if trial == 4:  # correlated keys and beta near 2: the largest entries of X
            k = k[:1] + 0.3 * k
            k /= np.linalg.norm(k, axis=1, keepdims=True)
            beta = rng.uniform(1.5, 2, 64).astype(np.float32)
        if trial == 3:  # strongly correlated keys: a badly conditioned M
            k = k[:1] + 0.1 * k
            k /= np.linalg.norm(k, axis=1, keepdims=True)
        kkt = (k @ k.T).astype(np.float32)
        tile = np.zeros(64 * PAD, np.float32)
        for i in range(64):
            tile[i * PAD:i * PAD + 64] = kkt[i]
        X = solve(tile, beta)
        M = np.eye(64) + np.tril(beta[:, None].astype(np.float64) * kkt.astype(np.float64), -1)
        ref = np.linalg.inv(M)
        # strictly below the diagonal (the identity would dominate a whole-matrix norm), per block
        lower = np.tril(np.ones((64, 64), bool), -1)
        rel = np.linalg.norm((X - ref)[lower]) / np.linalg.norm(ref[lower])
        block_err = max(np.abs(X - ref)[16 * a:16 * a + 16, 16 * b:16 * b + 16].max()
                        for a in range(4) for b in range(a + 1))
        column = column_solve(kkt, beta)
        column_rel = np.linalg.norm((column - ref)[lower]) / np.linalg.norm(ref[lower])
        worst = max(worst, rel, block_err / np.abs(ref[lower]).max())
        print(f"trial {trial}: strictly-lower X rel L2 {rel:.2e} (column solve in fp32: {column_rel:.2e}), worst "
              f"16x16 block max-abs error {block_err:.2e} (|X| max below the diagonal {np.abs(ref[lower]).max():.2f})")
    print(f"worst {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    TRUNCATE = "--rna" not in sys.argv[1:]
    SEPARATE_X = "--separate-x" in sys.argv[1:]
    sys.exit(main())
