"""Trial checks and timings in a child process, so one bad config costs one trial, not the study.

A kernel that faults (an illegal instruction, an illegal address) leaves a sticky error on its
CUDA context: every later launch in that process fails, so in-process tuning prunes every trial
after the culprit. A kernel that deadlocks never returns at all. Here the checker, timer and
anchor timer live in a spawned process: after a failure the child probes its context and, when
the context is gone, exits, and the next call starts a fresh child; a call that does not answer
in time is stopped the same way.
The builder stays in the tuner's process (nvcc needs no GPU).
"""
from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Callable

from .trial import Measurement, MeasurementUnavailable


class MeasurementLost(RuntimeError):
    """The measuring process died, hung, or lost its GPU context during a call."""


@dataclass(frozen=True)
class CallTimeouts:
    start_s: float = 300.0     # importing torch, creating the CUDA context
    check_s: float = 180.0     # loading a library, one forward, the float64 oracle
    time_s: float = 600.0      # every mix's rotated inputs (made on a child's first timing) and graph replays
    anchors_s: float = 1800.0  # FLA's Triton and FlashQLA's TileLang compile on first use


def _serve(conn, factory: Callable[[], Measurement]) -> None:
    """The child's loop: answer ("check" | "time" | "anchors", args) until told to stop."""
    try:
        measurement = factory()
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}".strip()))
        return
    methods = {"check": measurement.checker.check, "time": measurement.timer.time,
               "anchors": measurement.anchors.time if measurement.anchors is not None else None}
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:          # the tuner went away
            return
        if message is None:
            return
        method, args = message
        try:
            conn.send(("ok", methods[method](*args)))
        except Exception as exc:
            alive = measurement.context_alive() if measurement.context_alive is not None else True
            conn.send(("error", (f"{type(exc).__name__}: {exc}".strip(), alive)))
            if not alive:
                return


class MeasuringProcess:
    """One child at a time, started on first use and again after it is lost."""

    def __init__(self, factory: Callable[[], Measurement], timeouts: CallTimeouts = CallTimeouts()):
        self.factory, self.timeouts = factory, timeouts
        self._ctx = multiprocessing.get_context("spawn")   # a forked CUDA context is unusable
        self._process = None
        self._conn = None

    def _receive(self, timeout_s: float, what: str):
        if not self._conn.poll(timeout_s):
            self._stop()
            raise MeasurementLost(f"{what}: no answer within {timeout_s:g} s (a hung kernel?); the measuring "
                                  f"process was stopped and the next trial starts a fresh one")
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):
            self._process.join(timeout=10)   # the pipe closes a moment before the exit code is set
            code = self._process.exitcode
            self._stop()
            raise MeasurementLost(f"{what}: the measuring process died (exit code {code}); the next trial "
                                  f"starts a fresh one") from None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._process = self._ctx.Process(target=_serve, args=(child, self.factory), daemon=True,
                                          name="flashqla-tune-measure")
        self._process.start()
        child.close()
        self._conn = parent
        try:
            status, value = self._receive(self.timeouts.start_s, "starting the measuring process")
        except MeasurementLost as exc:
            raise MeasurementUnavailable(str(exc)) from None
        if status != "ready":
            self._stop()
            raise MeasurementUnavailable(f"the measuring process could not set up: {value}")

    def _stop(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=30)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def call(self, method: str, *args, timeout_s: float):
        if self._process is None:
            self._start()
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, ConnectionError, EOFError):
            self._stop()
            raise MeasurementLost(f"{method}: the measuring process was gone before the call") from None
        status, value = self._receive(timeout_s, method)
        if status == "ok":
            return value
        message, alive = value
        if alive:
            raise RuntimeError(message)
        self._stop()
        raise MeasurementLost(f"{message} [the GPU context was lost; the next trial starts a fresh measuring "
                              f"process]")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (BrokenPipeError, ConnectionError, EOFError):
                pass
        self._stop()


class _Checker:
    def __init__(self, process: MeasuringProcess):
        self.process = process

    def check(self, plan, handle):
        return self.process.call("check", plan, handle, timeout_s=self.process.timeouts.check_s)


class _Timer:
    def __init__(self, process: MeasuringProcess):
        self.process = process

    def time(self, plan, handle):
        return self.process.call("time", plan, handle, timeout_s=self.process.timeouts.time_s)


class _AnchorTimer:
    def __init__(self, process: MeasuringProcess):
        self.process = process

    def time(self, spec):
        return self.process.call("anchors", spec, timeout_s=self.process.timeouts.anchors_s)


def isolated(builder, factory: Callable[[], Measurement], *, anchors: bool,
             timeouts: CallTimeouts = CallTimeouts()) -> Measurement:
    """A Measurement whose checker, timer and (if anchors) anchor timer run in a child made by
    factory (a picklable callable: the child imports it); builder runs here. close() ends the child."""
    process = MeasuringProcess(factory, timeouts)
    return Measurement(builder, _Checker(process), _Timer(process), _AnchorTimer(process) if anchors else None,
                       close=process.close)
