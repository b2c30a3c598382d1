"""The protocol's rows: every head configuration crossed with every sequence-length mix
(DESIGN.md, "Benchmark protocol"), with filters for a quick subset. The scoreboard runs them; the
tuner times its candidates on the same length mixes."""
from __future__ import annotations

from dataclasses import dataclass

# (h_qk, h_v), in the protocol's order; the labels name the model they stand for.
HEAD_CONFIGS: tuple[tuple[int, int], ...] = (
    (2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16),
)
# Users' shapes beside the protocol's (DESIGN.md): Qwen3-Next-80B at TP 8 and 4, the widest
# published Qwen GDN configuration, and 32/32. Scoreboard rows only: the tuner's mix is the
# protocol's grid.
USER_HEAD_CONFIGS: tuple[tuple[int, int], ...] = ((2, 4), (4, 8), (16, 128), (32, 32))
HEAD_LABELS = {
    (2, 8): "397B TP8", (4, 16): "397B TP4", (8, 32): "397B TP2", (16, 64): "397B TP1",
    (16, 32): "35B/9B/4B TP1", (8, 24): "27B TP2", (16, 48): "27B TP1", (16, 16): "2B/0.8B TP1",
    (2, 4): "80B TP8", (4, 8): "80B TP4", (16, 128): "widest Qwen GDN",
}
# Sequence-length mixes; each is one varlen batch (B = 1 with cu_seqlens).
SEQLENS: tuple[tuple[int, ...], ...] = (
    (32768,), (8192,), (2048,), (28672, 4096), (16384, 16384), (4096, 28672),
    (12288, 4096), (1024, 7168), (8192,) * 4, (1024,) * 8,
)
# Scoreboard-only lengths: single sequences longer than the tuner's mix.
LONG_SEQLENS: tuple[tuple[int, ...], ...] = ((65536,), (131072,))
# Row sets (bench --rows): each a grid of head configurations x length mixes.
#   protocol  the protocol's grid (the default scoreboard, and the tuner's mix)
#   all       every head configuration (the protocol's and the users') x every mix (the ten and
#             the scoreboard-only ones)
#   users     the rows of "all" that "protocol" does not have, so the two runs join into "all"
ROW_SETS = ("protocol", "users", "all")
# The quick subset: a small, a long and a ragged mix on the smallest and largest configs.
QUICK_HEADS = ((2, 8), (16, 64))
QUICK_SEQLENS = ((2048,), (32768,), (1024, 7168))
HEAD_DIM = 128


@dataclass(frozen=True)
class Case:
    num_qk_heads: int
    num_v_heads: int
    seqlens: tuple[int, ...]
    head_k_dim: int = HEAD_DIM
    head_v_dim: int = HEAD_DIM

    @property
    def heads(self) -> str:
        return f"{self.num_qk_heads}/{self.num_v_heads}"

    @property
    def seqlens_label(self) -> str:
        return format_seqlens(self.seqlens)

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def name(self) -> str:
        return f"{self.heads} {self.seqlens_label}"


def format_seqlens(seqlens: tuple[int, ...]) -> str:
    """1x32768, 28672+4096, 16384+16384, 8192x4: the protocol's spelling (x for 3 or more)."""
    if len(seqlens) > 2 and len(set(seqlens)) == 1:
        return f"{seqlens[0]}x{len(seqlens)}"
    if len(seqlens) == 1:
        return f"1x{seqlens[0]}"
    return "+".join(str(s) for s in seqlens)


def parse_seqlens(text: str) -> tuple[int, ...]:
    """Inverse of format_seqlens; also accepts a bare length ("2048")."""
    text = text.strip()
    try:
        if "+" in text:
            out = tuple(int(p) for p in text.split("+"))
        elif "x" in text:
            a, b = text.split("x")
            out = (int(b),) if int(a) == 1 else (int(a),) * int(b)
        else:
            out = (int(text),)
    except ValueError:
        raise ValueError(f"bad sequence-length mix {text!r}: use e.g. 1x32768, 28672+4096 or 8192x4") from None
    if not out or any(n <= 0 for n in out):
        raise ValueError(f"bad sequence-length mix {text!r}: lengths must be positive")
    return out


def parse_heads(text: str) -> tuple[int, int]:
    """"16/64" -> (16, 64), checked for h_v a multiple of h_qk."""
    try:
        a, b = (int(p) for p in text.strip().split("/"))
    except ValueError:
        raise ValueError(f"bad head configuration {text!r}: use h_qk/h_v, e.g. 16/64") from None
    if a <= 0 or b <= 0 or b % a:
        raise ValueError(f"bad head configuration {text!r}: h_v must be a positive multiple of h_qk")
    return a, b


def all_cases() -> list[Case]:
    return [Case(hq, hv, s) for hq, hv in HEAD_CONFIGS for s in SEQLENS]


def select_cases(heads=None, seqlens=None, quick: bool = False, rows: str = "protocol") -> list[Case]:
    """A row set's cases (ROW_SETS), filtered. heads / seqlens: iterables of strings ("16/64",
    "1x32768") or tuples, replacing the set's head configurations / mixes; quick picks
    QUICK_HEADS x QUICK_SEQLENS unless those are given. rows="users" then drops the protocol
    grid's rows."""
    if rows not in ROW_SETS:
        raise ValueError(f"unknown row set {rows!r}; known: {', '.join(ROW_SETS)}")
    head_list = [parse_heads(h) if isinstance(h, str) else tuple(h) for h in heads] if heads else None
    seq_list = [parse_seqlens(s) if isinstance(s, str) else tuple(s) for s in seqlens] if seqlens else None
    if quick:
        head_list = head_list or list(QUICK_HEADS)
        seq_list = seq_list or list(QUICK_SEQLENS)
    wide = rows != "protocol"
    head_list = head_list or list(HEAD_CONFIGS + USER_HEAD_CONFIGS if wide else HEAD_CONFIGS)
    seq_list = seq_list or list(SEQLENS + LONG_SEQLENS if wide else SEQLENS)
    cases = [Case(hq, hv, s) for hq, hv in head_list for s in seq_list]
    if rows == "users":
        cases = [c for c in cases if (c.num_qk_heads, c.num_v_heads) not in HEAD_CONFIGS or c.seqlens not in SEQLENS]
        if not cases:
            raise ValueError("the selection holds only protocol rows, which --rows users leaves out")
    return cases
