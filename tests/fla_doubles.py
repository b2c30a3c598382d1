"""A stand-in for FLA's backend registry (fla.backends in fla-core 0.6), for machines where fla
cannot be imported (it needs triton). It behaves as FLA's does for what the tests use:
register(op)(cls) instantiates cls and keys it by backend_type, dispatch tries backends by
ascending priority, skips disabled ones (env var "0"), asks <fn>_verifier (an exception is a
refusal) and falls back to the default function."""
from __future__ import annotations

import os
import types


class FakeBaseBackend:
    backend_type = "base"
    package_name = None
    env_var = None
    default_enable = True
    priority = 5
    verifier = None

    def is_enabled(self) -> bool:
        if self.env_var is None:
            return True
        return os.environ.get(self.env_var, "1" if self.default_enable else "0") != "0"

    def verify(self, function_name, *args, **kwargs):
        verifier = self.verifier or getattr(self, f"{function_name}_verifier", None)
        if verifier is None:
            return True, None
        try:
            return verifier(*args, **kwargs)
        except Exception as exc:
            return False, str(exc)


def make_fake_fla_backends():
    registries: dict[str, dict] = {}
    log: list[tuple[str, str, str | None]] = []

    def register(op):
        def decorator(cls):
            registries.setdefault(op, {})[cls.backend_type] = cls()
            return cls
        return decorator

    def dispatch(op, default):
        def wrapper(*args, **kwargs):
            for backend in sorted(registries.get(op, {}).values(), key=lambda b: b.priority):
                if not backend.is_enabled():
                    continue
                ok, reason = backend.verify(default.__name__, *args, **kwargs)
                log.append((backend.backend_type, "accept" if ok else "reject", reason))
                if ok:
                    return getattr(backend, default.__name__)(*args, **kwargs)
            return default(*args, **kwargs)
        return wrapper

    return types.SimpleNamespace(BaseBackend=FakeBaseBackend, register=register, dispatch=dispatch,
                                 registries=registries, log=log)


class FakeFlashQLABackend(FakeBaseBackend):
    backend_type = "flash_qla"
    priority = 3

    def chunk_gated_delta_rule(self, *args, **kwargs):
        return "FakeFlashQLA result"
