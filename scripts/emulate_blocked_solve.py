"""The prep's blocked A0 solve emulated in fp32 on the CPU, thread by thread and stage by stage,
against the column substitution the kernel runs and a float64 inverse: a check of the
decomposition (which thread reads which K K^T entry, and when) before the kernel ran on the H200.
kk holds K K^T; X goes into its upper triangle. The kernel patch ran in the ninth session, correct
but slower, and was not kept (`git show 08115bb:docs/pending/prep-blocked-solve.patch`,
docs/kernel-notes.md).

    python3 scripts/emulate_blocked_solve.py
"""
import numpy as np

def column_solve(kk, beta):
    X = np.zeros((64, 64), np.float32)
    for c in range(64):
        x = np.zeros(64, np.float32)
        for i in range(64):
            s = np.float32(0)
            for j in range(i):
                s = np.float32(s + kk[i, j] * x[j])
            x[i] = 0 if i < c else (1 if i == c else np.float32(-beta[i] * s))
        X[:, c] = x
    return X

def blocked_solve(kk_in, beta):
    kk = kk_in.copy()
    # stage 1: diagonal blocks, thread t: block b = t // 16, column j = t
    for t in range(64):
        b, j = t // 16, t
        x = {}
        for i in range(16 * b, 16 * b + 16):
            s = np.float32(0)
            for m in range(16 * b, i):
                xm = 0 if m < j else (1 if m == j else x[m])
                s = np.float32(s + kk[i, m] * np.float32(xm))
            x[i] = np.float32(0) if i < j else (np.float32(1) if i == j else np.float32(-beta[i] * s))
        for i in range(j + 1, 16 * b + 16):
            kk[j, i] = x[i]           # X[i][j] into the upper triangle
    def X_of(m, j):                   # X[m][j] as a thread reads it from kk
        return np.float32(0) if m < j else (np.float32(1) if m == j else kk[j, m])
    for d, per_col in ((1, 1), (2, 2), (3, 4)):
        updates = []
        for t in range(64):
            col, part = t // per_col, t % per_col
            nblocks = 4 - d
            if col >= nblocks * 16:
                continue
            b = col // 16; a = b + d; j = 16 * b + col % 16
            rows = range(16 * a + part * 16 // per_col, 16 * a + (part + 1) * 16 // per_col)
            xs = [X_of(m, j) for m in range(16 * b, 16 * a)]  # registers: the column above block a
            T = {}
            for i in rows:
                s = np.float32(0)
                for m, xm in zip(range(16 * b, 16 * a), xs):
                    s = np.float32(s + kk[i, m] * xm)
                T[i] = np.float32(beta[i] * s)
            updates.append((j, a, T))
        # the shuffle: every thread of a column sees the column's 16 T values
        cols = {}
        for j, a, T in updates:
            cols.setdefault((j, a), {}).update(T)
        writes = []
        for (j, a), T in cols.items():
            for i in range(16 * a, 16 * a + 16):
                s = T[i]
                for r in range(16 * a, i):
                    s = np.float32(s + kk[r, i] * T[r])  # X_aa[i][r] = kk[r][i]
                writes.append((j, i, np.float32(-s)))
        for j, i, v in writes:          # after the stage's barrier
            kk[j, i] = v
    X = np.zeros((64, 64), np.float32)
    for c in range(64):
        for i in range(64):
            X[i, c] = X_of(i, c) if i >= c else 0
    return X

rng = np.random.default_rng(0)
for trial in range(3):
    k = rng.standard_normal((64, 128)); k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = rng.uniform(0, 2 if trial == 2 else 1, 64).astype(np.float32)
    if trial == 1:
        beta[40:] = 0   # a tail chunk: rows past L have beta 0
    kk = (k @ k.T).astype(np.float32)
    L = np.tril(beta[:, None].astype(np.float64) * kk.astype(np.float64), -1)
    X64 = np.linalg.inv(np.eye(64) + L)
    Xc, Xb = column_solve(kk, beta), blocked_solve(kk, beta)
    rel = lambda A: np.linalg.norm(A - X64) / np.linalg.norm(X64)
    print(f"trial {trial}: column rel {rel(Xc):.2e}  blocked rel {rel(Xb):.2e}  blocked vs column {np.linalg.norm(Xb - Xc) / np.linalg.norm(Xc):.2e}")
