"""What the vLLM and SGLang routes share: the switch, the pack they load, the GDN layer a call
belongs to, and how a refused call is reported.

Both serving stacks keep GDN states in a pool of one slot per request, laid out v-first
([slots, Hv, V, K]), so a route needs a pack with v-first plans (`build --state-layout vk`).
A call the route cannot honour raises UnsupportedCall naming the argument; the route then hands
that call to the stack's own kernel and logs the reason once. Nothing here imports a serving
stack or the GPU runtime until a pack is loaded.
"""
from __future__ import annotations

import logging
import os
import re
import threading

ENV_VAR = "FLASHQLA_TUNE_PACK"  # the folder of the pack to route to; unset or empty: no route
V_FIRST = "vk"

logger = logging.getLogger("flashqla_tune.integrations")

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


class UnsupportedCall(ValueError):
    """A serving call carries an argument or value the pack's op cannot honour."""


class PackMismatch(RuntimeError):
    """The pack the switch names cannot serve this stack at all (a configuration error, raised
    on the first call rather than handed back call by call)."""


def pack_from_env(environ=None) -> str | None:
    """The pack folder the switch names, or None when the route is off."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    return value or None


def decoder_layer_from_name(name: str | None) -> int | None:
    """The decoder-layer index in a module name such as `model.layers.4.linear_attn` (the last
    `layers.<i>` part, so a wrapper prefix such as `language_model.` does not matter), or None."""
    if not name:
        return None
    found = _LAYER_NAME.findall(name)
    return int(found[-1]) if found else None


def gdn_layer_of_decoder(pack_ops, decoder_layer: int | None) -> int | None:
    """The pack's GDN layer (its calibration row) for a decoder-layer index, through the
    calibration's `decoder_layer` field; None (the model-wide table) when the index is unknown.
    A decoder layer the calibration has no GDN layer for is refused: the pack is for another
    model, or the layer is not a GDN layer."""
    if decoder_layer is None:
        return None
    by_decoder = {row.decoder_layer: row.layer for row in pack_ops.calibration.layers}
    if decoder_layer not in by_decoder:
        raise UnsupportedCall(f"decoder layer {decoder_layer} is not a GDN layer of the pack's model (its GDN "
                              f"layers are decoder layers {sorted(by_decoder)})")
    return by_decoder[decoder_layer]


def require_v_first(pack_ops, pack) -> None:
    """Refuse a pack without v-first plans: the serving state pools are [slots, Hv, V, K]."""
    layouts = sorted({p.plan.spec.state_layout for p in pack_ops.plans})
    if V_FIRST not in layouts:
        raise PackMismatch(f"pack {pack} has state layouts {layouts}; vLLM and SGLang keep v-first states "
                              f"[slots, Hv, V, K]: build the pack with --state-layout {V_FIRST}")


class PackSource:
    """The pack a route runs on, loaded on first use (a serving process knows its tensor-parallel
    rank only once its distributed state is up, after plugins load). load(pack, tp_rank, tp_size)
    and tp() -> (rank, size) are the stack's or a test's."""

    def __init__(self, pack, load, tp):
        self.pack, self._load, self._tp = pack, load, tp
        self._ops = None
        self._error: Exception | None = None
        self._lock = threading.Lock()

    def get(self):
        """The loaded pack; a pack that fails to load or is not v-first raises on every call
        (loaded once, not retried per call)."""
        if self._ops is None:
            with self._lock:
                if self._ops is None and self._error is None:
                    try:
                        rank, size = self._tp()
                        ops = self._load(self.pack, rank, size)
                        require_v_first(ops, self.pack)
                    except Exception as exc:
                        self._error = exc
                        raise
                    self._ops = ops
                if self._error is not None:
                    raise self._error
        return self._ops


def refusal_types() -> tuple[type, ...]:
    """The exceptions that send a call back to the stack's kernel: the route's refusals and the
    op's (ops.UnsupportedError: heads, dims, dtypes or a GPU the pack has no kernel for)."""
    from ..ops import UnsupportedError

    return UnsupportedCall, UnsupportedError


def default_load(pack, tp_rank, tp_size):
    from ..packed_ops import load

    return load(pack, tp_rank, tp_size)


class Refusals:
    """Counts the calls a route handed back to the stack's kernel, and logs each reason once."""

    def __init__(self, route: str):
        self.route = route
        self.counts: dict[str, int] = {}

    def note(self, reason: str) -> None:
        if reason not in self.counts:
            logger.warning("%s: this call runs on the stack's own kernel: %s", self.route, reason)
        self.counts[reason] = self.counts.get(reason, 0) + 1
