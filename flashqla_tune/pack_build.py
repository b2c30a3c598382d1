"""flashqla-tune build: checkpoint -> calibrate -> plans per TP degree -> compile -> tune -> pack.

Per TP degree t the rank's head configuration is (Hqk/t, Hv/t); a GVA model also gets the
Hqk = Hv form (Hv/t, Hv/t) for callers that repeat q/k first. Without a GPU (or with
tune=False) the pack keeps the default tiles and says "untuned sm_90a". The pack is staged
beside its destination and swapped in by rename; an existing pack of the same checkpoint and
options is reused, one of another checkpoint is rebuilt. The pack also carries the eager op's C++
host path, compiled here for this torch and Python (host_path.build_into; no GPU needed), so
that loading the pack compiles nothing. The kernels and the host path depend only on the spec,
so they compile side by side (nvcc and the host compiler are separate processes). A pack that is
up to date but whose host extension is missing (where this machine can compile one) or does not
fit this torch and Python gets only host/ rebuilt.

`--out` is replaced only when it is missing, empty, or holds this tool's pack (pack.check_replaceable);
what a build that died left beside it is restored or deleted first (pack.recover). The checkpoint
hash trusts each file's remembered digest while its size and mtime are unchanged; rehash=True, and
every tuned build, hash the content again.

The checkpoint is checked against the supported-shape table before any work, and a finished
calibration (calibration=FILE) replaces calibrating when its checkpoint hash is this one's.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import __version__, cache, environment
from .model_config import read_model_config
from .pack import (BINARIES, CALIBRATION, HOST, MANIFEST, NATIVE, QK_REPEATED, SCHEMA_VERSION, UNTUNED_TARGET,
                   BackwardLibrary, HostExtension, Manifest, PackError, PackPlan, check_binaries, check_calibration,
                   check_replaceable, publish, read_manifest, recover, sha256_file, staging_dir, write_manifest)
from .plan import KernelPlan, default_plan
from .spec import GDNSpec
from .supported_shapes import check_checkpoint_dtype, check_model, check_spec


@dataclass(frozen=True)
class PlannedHeads:
    tp_size: int
    form: str
    spec: GDNSpec


@dataclass
class BuildReport:
    pack: Path
    manifest: Manifest
    reused: bool
    reason: str                      # why it was rebuilt or reused
    seconds: dict                    # per stage


def parse_tp(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in str(text).split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--tp {text!r}: give comma-separated degrees, e.g. 1,2,4,8") from None
    if not sizes or any(t < 1 for t in sizes):
        raise ValueError(f"--tp {text!r}: degrees must be positive integers")
    return tuple(sorted(set(sizes)))


def plan_heads(spec: GDNSpec, tp_sizes) -> list[PlannedHeads]:
    """Every (degree, form) a pack carries, with the rank's spec."""
    out = []
    for t in tp_sizes:
        if spec.num_qk_heads % t or spec.num_v_heads % t:
            raise ValueError(f"tensor-parallel degree {t} does not divide the model's heads "
                             f"(Hqk={spec.num_qk_heads}, Hv={spec.num_v_heads})")
        hqk, hv = spec.num_qk_heads // t, spec.num_v_heads // t
        out.append(PlannedHeads(t, NATIVE, spec.with_heads(hqk, hv)))
        if hqk != hv:
            out.append(PlannedHeads(t, QK_REPEATED, spec.with_heads(hv, hv)))
    return out


def toolchain() -> dict:
    import torch

    return {"nvcc": environment.nvcc_version(), "cutlass": environment.cutlass_version(), "torch": torch.__version__}


def _reuse_reason(out: Path, sha: str, tp_sizes, options: dict, want_tuned_on, spec: GDNSpec | None = None
                  ) -> tuple[bool, str]:
    """(reuse?, why) for an existing folder at out; spec, when given, is the model spec to build.
    The host extension is judged apart (_host_refresh_reason): it alone never rebuilds the kernels."""
    check_replaceable(out)
    if not out.exists() or not any(out.iterdir()):
        return False, "new pack"
    try:
        old = read_manifest(out)
        check_binaries(out, old)
        check_calibration(out, old)
    except PackError as exc:
        return False, f"existing pack unusable ({exc})"
    if old.schema_version != SCHEMA_VERSION:
        return False, f"pack schema version {old.schema_version}, this flashqla-tune writes {SCHEMA_VERSION}"
    if old.checkpoint_sha256 != sha:
        return False, f"checkpoint changed (pack has {old.checkpoint_sha256[:16]}, checkpoint is {sha[:16]})"
    if old.tool_version != __version__:
        return False, f"pack made by flashqla-tune {old.tool_version}, this is {__version__}"
    if spec is not None and old.spec != spec:
        return False, f"spec changed ({old.spec.name} -> {spec.name})"
    if tuple(old.tp_sizes) != tuple(tp_sizes):
        return False, f"TP degrees changed ({list(old.tp_sizes)} -> {list(tp_sizes)})"
    if old.build != options:
        return False, f"build options changed ({old.build} -> {options})"
    if want_tuned_on is not None and (not old.tuned or old.gpu.get("name") != want_tuned_on):
        return False, f"pack is {old.target}; tuning for {want_tuned_on} was asked"
    backward_why = _backward_stale_reason(old)
    if backward_why is not None:
        return False, backward_why
    return True, f"up to date ({old.target}, checkpoint {sha[:16]})"


def _backward_stale_reason(manifest: Manifest) -> str | None:
    """Why a pack's backward kernel libraries are not the ones this flashqla_tune's backward uses (one
    of a kind it uses for these head dims is not recorded, or is recorded for another ABI or spec),
    or None (they are, or the head dims have none)."""
    from .backward import libraries

    K, V = manifest.spec.head_k_dim, manifest.spec.head_v_dim
    for kind, module in libraries.modules().items():
        try:
            want = module.spec_for(K, V)
        except ValueError:
            continue
        record = manifest.backward_library(kind)
        if record is None:
            return f"the pack carries no backward {kind} kernels"
        if record.abi_version != module.ABI_VERSION or record.spec != want.to_dict():
            return (f"its backward {kind} kernels are stale ({kind} ABI {record.abi_version}, {record.spec}; this "
                    f"flashqla-tune uses ABI {module.ABI_VERSION}, {want.to_dict()})")
    return None


def _host_refresh_reason(manifest: Manifest, build_host=None) -> str | None:
    """Why an otherwise up-to-date pack needs its host/ rebuilt, or None: its extension does not
    fit this process, or it has none and this machine can compile one."""
    from . import host_path

    if manifest.host_extension is not None:
        why = host_path.mismatch(manifest.host_extension)
        return None if why is None else f"its C++ host extension does not fit this process ({why})"
    if build_host is not None or _can_compile_host():
        return "it has no C++ host extension and this machine can compile one"
    return None


def _can_compile_host() -> bool:
    """A C++ compiler and Python's headers are here (what host_path.build_into needs)."""
    compiler = (os.environ.get("CXX") or "c++").split()[0]
    include = sysconfig.get_paths().get("include")
    return shutil.which(compiler) is not None and include is not None and (Path(include) / "Python.h").is_file()


def _rebuild_host(out: Path, old: Manifest, build_host, log, why: str, seconds: dict) -> BuildReport:
    """Publish `out` again with only host/ compiled anew (the kernels, calibration and options are
    kept byte for byte). Where the compile fails the pack stays as it is, and the report says so."""
    import torch

    log(f"build: {out} is up to date except its host path: {why}; rebuilding only {HOST}/")
    staging = staging_dir(out)
    try:
        t = time.perf_counter()
        host = _host_extension(staging, build_host, log)
        seconds["host"] = time.perf_counter() - t
        if host is None:
            shutil.rmtree(staging, ignore_errors=True)
            return BuildReport(out, old, True, f"up to date ({old.target}); its C++ host path could not be "
                                               f"rebuilt here, see the line above", seconds)
        from .pack_signing import SIGNATURE

        was_signed = (out / SIGNATURE).is_file()
        for item in out.iterdir():
            if item.name in (HOST, MANIFEST, SIGNATURE):   # a signature covers the old manifest: void now
                continue
            if item.is_dir() and not item.is_symlink():
                shutil.copytree(item, staging / item.name, symlinks=True)
            else:
                shutil.copy2(item, staging / item.name, follow_symlinks=False)
        manifest = dataclasses.replace(old, host_extension=host,
                                       toolchain={**old.toolchain, "torch": torch.__version__},
                                       created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine=platform.machine())
        check_binaries(staging, manifest)
        _share(staging)
        write_manifest(staging, manifest)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    unsigned = "; its signature covered the old files and was dropped: sign it again (--sign KEY)" if was_signed else ""
    if unsigned:
        log(f"build: {out}{unsigned}")
    return BuildReport(out, manifest, False, f"only {HOST}/ rebuilt: {why}{unsigned}", seconds)


def _share(folder: Path) -> None:
    for path in folder.rglob("*"):      # a pack is shared between users and machines
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _tuning_record(result) -> dict:
    best, default = result.best, result.default
    return {"study": result.study_name, "trials": len(result.trials), "stopped": result.stopped_because,
            "best_trial": None if best is None else best.number,
            "times_ms": None if best is None else best.user_attrs.get("times_ms"),
            "default_times_ms": None if default is None else default.user_attrs.get("times_ms"),
            "speedup_over_default": result.speedup,
            "anchors": result.anchors,
            "speedup_over_anchors": {name: result.speedup_over(name) for name in result.anchors}}


def build_pack(checkpoint, out, tp_sizes=(1,), *, tune: bool = True, budget_s: float | None = None,
               jobs: int | None = None, force: bool = False, corpus=None, seq_len: int | None = None,
               max_sequences: int | None = None, progress: bool = True, compare_anchors: bool = False,
               log=None, build_host=None, settings=None, calibration=None, batch_size: int = 8,
               device=None, offload: bool = False, qkv_dtype: str | None = None,
               state_layout: str | None = None, rehash: bool = False) -> BuildReport:
    """build_host(folder) -> host_path.PrebuiltExtension compiles the C++ host path into the pack
    (default host_path.build_into; injectable for tests). settings (CalibrationSettings), corpus,
    seq_len, max_sequences, batch_size, device and offload are the calibration's; calibration
    names a finished artifact to use instead (it must be this checkpoint's). qkv_dtype and
    state_layout replace the checkpoint's in the pack's spec (e.g. "vk" for v-first state pools); the
    checkpoint's state layout is the one its family's GDN layer calls with (model_config: vk for
    FLA's layer, kv for transformers' layers).
    rehash=True hashes every checkpoint file's content again (a tuned build always does)."""
    log = log or _stderr_log
    out = Path(out)
    if out.parent.exists() and not out.parent.is_dir():
        raise PackError(f"--out {out}: {out.parent} is a file, not a folder")
    for line in recover(out, clean=True):     # what a build that died here left behind
        log(f"build: {line}")
    check_replaceable(out)                    # before any work: --force does not make a folder ours
    tp_sizes = tuple(sorted(set(tp_sizes)))
    if checkpoint is None:
        from .calibrate.default_model import default_model_path

        checkpoint = default_model_path()
    ckpt = Path(checkpoint)
    # Everything that can be refused from config.json alone is refused before any work.
    model = read_model_config(ckpt)
    check_model(model, str(ckpt))
    check_checkpoint_dtype(model, qkv_dtype, str(ckpt))
    changes = {k: v for k, v in (("qkv_dtype", qkv_dtype), ("state_layout", state_layout)) if v is not None}
    spec = dataclasses.replace(model.spec, **changes) if changes else model.spec
    check_spec(spec, str(ckpt))
    heads = plan_heads(spec, tp_sizes)
    if calibration is not None:
        calibration = Path(calibration)
        if not calibration.is_file():
            raise PackError(f"--calibration {calibration}: no such file")
        if corpus is not None or seq_len is not None or max_sequences is not None or settings is not None:
            raise ValueError("a finished calibration brings its own corpus and settings: give calibration= "
                             "or the calibration options, not both")
    from .content_hash import HashCache, checkpoint_hash
    from .calibration_artifact import load_calibration
    from .calibration_settings import CalibrationSettings

    gpu = environment.gpu_info() if tune else None
    if tune and gpu is None:
        log("build: no CUDA GPU here, so the pack keeps the default tiles (untuned sm_90a)")
    elif tune and gpu.capability != (9, 0):
        log(f"build: {gpu.name} is {gpu.arch}, not sm_90: the pack keeps the default tiles (untuned sm_90a)")
        gpu = None
    options = {"corpus": None if corpus is None else str(corpus), "seq_len": seq_len, "max_sequences": max_sequences}
    if settings is not None and settings != CalibrationSettings():
        options["settings"] = settings.to_dict()        # recorded only when not the defaults
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    sha = checkpoint_hash(ckpt, HashCache(rehash=rehash or gpu is not None))
    seconds["hash"] = time.perf_counter() - t0
    given = None
    if calibration is not None:
        given = load_calibration(calibration, checkpoint_sha256=sha)   # refuses another checkpoint's, or a damaged file
        options["calibration_sha256"] = sha256_file(calibration)
    if not force:
        reuse, why = _reuse_reason(out, sha, tp_sizes, options, gpu.name if gpu else None, spec)
        if reuse:
            old = read_manifest(out)
            host_why = _host_refresh_reason(old, build_host)
            if host_why is not None:
                return _rebuild_host(out, old, build_host, log, host_why, seconds)
            return BuildReport(out, old, True, why, seconds)
    else:
        why = "--force"
    log(f"build: {why}; building {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out)
    try:
        plans = {h: default_plan(h.spec) for h in heads}
        cal = _calibration(given, calibration, ckpt, sha, staging, seconds, log, corpus=corpus,
                           settings=settings, seq_len=seq_len, max_sequences=max_sequences, batch_size=batch_size,
                           device=device, offload=offload, progress=progress, qkv_dtype=qkv_dtype)
        # The kernels (nvcc), the backward's kernel libraries (nvcc) and the C++ host path (the host
        # compiler) need only the spec: side by side.
        (staging / BINARIES).mkdir()
        with ThreadPoolExecutor(max_workers=2) as pool:
            host_future = pool.submit(_timed, _host_extension, staging, build_host, log)
            backward_future = pool.submit(_backward_libraries, staging, spec, log)
            t = time.perf_counter()
            try:
                compile_plans(list(plans.values()), jobs=jobs, progress=progress, log=log)
            finally:
                seconds["compile"] = time.perf_counter() - t
            host, seconds["host"] = host_future.result()   # after a failed compile, its error is the one raised
            backward = backward_future.result()
        tuning: dict[KernelPlan, dict] = {}
        if gpu is not None:
            t = time.perf_counter()
            plans, tuning = _tune(plans, gpu, budget_s, jobs, progress, log, compare_anchors)
            seconds["tune"] = time.perf_counter() - t
        entries = {e.plan: e for e in cache.get_kernels(list(dict.fromkeys(plans.values())), jobs=jobs)}
        pack_plans = []
        segment_tables: dict[KernelPlan, tuple[int, ...]] = {}
        for h, plan in plans.items():
            rel = f"{BINARIES}/{plan.name}.so"
            dest = staging / rel
            if not dest.exists():
                shutil.copyfile(entries[plan].so_path, dest)
            if plan not in segment_tables:
                segment_tables[plan] = cp_segment_table(cal, plan, gpu)
                if gpu is not None:  # measured refinement of the cost model's table
                    t = time.perf_counter()
                    segment_tables[plan], record = tune_segments(cal, plan, segment_tables[plan], log)
                    tuning[plan] = {**(tuning.get(plan) or {}), "segments": record}
                    seconds["tune_segments"] = seconds.get("tune_segments", 0.0) + time.perf_counter() - t
            pack_plans.append(PackPlan(h.tp_size, h.form, plan, rel, sha256_file(dest), tuning.get(plan),
                                       segment_tables[plan]))
        gpu_record = ({"name": gpu.name, "arch": gpu.arch, "driver": gpu.driver, "sm_count": gpu.sm_count}
                      if gpu is not None else {"target": UNTUNED_TARGET, "name": None, "arch": "sm_90a"})
        manifest = Manifest(spec=spec, checkpoint_sha256=sha, checkpoint_path=str(ckpt.resolve()),
                            calibration_sha256=sha256_file(staging / CALIBRATION),
                            num_gdn_layers=model.num_gdn_layers, tp_sizes=tp_sizes, gpu=gpu_record,
                            toolchain=toolchain(), plans=tuple(pack_plans), build=options, host_extension=host,
                            backward=backward)
        _share(staging)
        write_manifest(staging, manifest)     # last: its presence marks a finished pack
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds["total"] = time.perf_counter() - t0
    return BuildReport(out, manifest, False, why, seconds)


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _timed(fn, *args):
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def _calibration(given, given_path, ckpt: Path, sha: str, staging: Path, seconds: dict, log, **calibrate_options):
    """The pack's calibration, written into staging: the given artifact (copied byte for byte, with
    its report made again beside it), or a fresh calibration of the checkpoint."""
    from .calibrate.report import summary, write_report

    if given is not None:
        shutil.copyfile(given_path, staging / CALIBRATION)
        write_report(given, staging)
        log(f"build: calibration from {given_path} (checkpoint {given.checkpoint_sha256[:16]}); not calibrating")
        for line in summary(given):
            log(line)
        return given
    from .calibrate.pipeline import calibrate_checkpoint

    t = time.perf_counter()
    options = dict(calibrate_options)
    cal = calibrate_checkpoint(ckpt, options.pop("corpus"), options.pop("settings"), out_dir=staging,
                               **options).calibration
    seconds["calibrate"] = time.perf_counter() - t
    for line in summary(cal):
        log(line)
    if cal.checkpoint_sha256 != sha:
        raise PackError(f"{ckpt} changed while it was being calibrated ({sha[:16]} -> "
                        f"{cal.checkpoint_sha256[:16]}); build again")
    return cal


def compile_plans(plans, jobs: int | None = None, force: bool = False, progress: bool = True, log=None) -> list:
    """The cache entries of plans (cache.get_kernels), with progress when asked: a line saying how
    many are cached and how many to build, then a line per plan as each batch of parallel nvcc
    processes (jobs, default build.default_jobs) finishes."""
    from .build import default_jobs

    log = log or _stderr_log
    unique = list(dict.fromkeys(plans))
    found = {} if force else {p: e for p in unique if (e := cache.lookup(p)) is not None}
    todo = [p for p in unique if p not in found]
    if todo:
        batch = jobs or default_jobs(len(todo))
        if progress:
            log(f"compile: {len(todo)} plan(s) to build with {min(batch, len(todo))} nvcc process(es)"
                f"{f', {len(found)} cached' if found else ''}")
        start = time.perf_counter()
        for i in range(0, len(todo), batch):
            for e in cache.get_kernels(todo[i:i + batch], jobs=jobs, force=force):
                found[e.plan] = e
                if progress:
                    what = f"built in {e.build_seconds:.1f} s" if e.built else "built meanwhile by another process"
                    done = sum(p in found for p in todo)
                    log(f"compile [{done}/{len(todo)}] {e.plan.name}: {what} ({time.perf_counter() - start:.0f} s "
                        f"elapsed)")
    elif progress and unique:
        log(f"compile: all {len(unique)} plan(s) cached")
    return [found[p] for p in plans]


def _backward_libraries(staging: Path, spec: GDNSpec, log) -> tuple[BackwardLibrary, ...]:
    """The backward's kernel libraries (chain, prep and chunk: backward.libraries) for the model's head
    dims, built side by side through the kernel cache (one nvcc each) and copied into the pack's
    binaries (so a pack's op trains with nothing compiled where it runs). A kind with no library for
    these head dims is left out, said in the log: the backward runs that part in torch."""
    from .backward import libraries

    K, V = spec.head_k_dim, spec.head_v_dim
    wanted = []
    for kind, module in libraries.modules().items():
        try:
            wanted.append((kind, module, module.spec_for(K, V)))
        except ValueError as exc:
            log(f"build: no backward {kind} kernels for K={K}, V={V} ({exc}); the pack's backward runs that "
                f"part in torch")
    if not wanted:
        return ()
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        entries = list(pool.map(lambda w: cache.get_kernels([w[2]], w[1].LIBRARIES.renderer, jobs=1)[0], wanted))
    records = []
    for (kind, module, lib_spec), entry in zip(wanted, entries):
        log(f"build: the backward's {kind} kernels {lib_spec.name} ({'built' if entry.built else 'cached'})")
        rel = f"{BINARIES}/{lib_spec.name}.so"
        shutil.copyfile(entry.so_path, staging / rel)
        records.append(BackwardLibrary(kind, rel, sha256_file(staging / rel), lib_spec.to_dict(),
                                       module.ABI_VERSION))
    return tuple(records)


def _host_extension(staging: Path, build_host, log) -> HostExtension | None:
    """The C++ host path compiled into staging/host/, as the manifest records it; None (with a line in
    the log) where this machine cannot compile it: the pack's eager calls then take the Python path."""
    if build_host is None:
        from .host_path import build_into as build_host
    try:
        built = build_host(staging / HOST)
    except Exception as exc:  # no C++ compiler or no Python headers: the pack still works, on the Python path
        log(f"build: the C++ host path could not be compiled ({type(exc).__name__}: {exc}); the pack's eager "
            f"calls will take the Python host path")
        return None
    rel = Path(built.path).relative_to(staging).as_posix()
    return HostExtension(rel, sha256_file(built.path), built.module, built.torch, built.python_abi,
                         built.sources_sha256, built.abi_version)


def cp_segment_table(cal, plan: KernelPlan, gpu) -> tuple[int, ...]:
    """The CP split a plan applies with this calibration: the cost model on the profile pooled
    over every layer and head (DESIGN.md: the plan decides the splits from the calibration), for
    this GPU's SMs, or an H200's 132 for an untuned pack."""
    from .cp_cost_model import WarmupProfile
    from .warmup_tables import profile_segment_lengths

    sms = gpu.sm_count if gpu is not None else 132
    return tuple(profile_segment_lengths(WarmupProfile.from_calibration(cal), plan, sms))


def tune_segments(cal, plan: KernelPlan, model_lengths: tuple[int, ...], log, time_fn=None):
    """The segment-length stage (flashqla_tune/tune/segments.py) for one plan, timed with the
    model-wide warm-up table of the plan's first v-heads (rank 0 of its tensor-parallel degree)
    and the calibration's eps; time_fn defaults to the GPU's. Candidates stay longer than the
    longest window of any layer and head, as the cost model's do. Returns (table, manifest record)."""
    from .cp_cost_model import WarmupProfile
    from .tune.segments import gpu_time_fn, tune_segment_table
    from .warmup_tables import describe_splits

    warmup = tuple(cal.model_table()[:plan.spec.num_v_heads])
    eps = float(cal.settings.eps)
    time_fn = time_fn or gpu_time_fn(plan, warmup, eps)
    max_window = WarmupProfile.from_calibration(cal).max_window
    result = tune_segment_table(model_lengths, max_window, time_fn)
    gains = ", ".join(f"{t} tokens {g:.3f}x" for t, g in sorted(result.gains().items()))
    log(f"segments {plan.name}: {describe_splits(result.lengths)} (cost model: {describe_splits(result.model_lengths)}); "
        f"measured choice vs the cost model's: {gains}")
    return result.lengths, result.record()


def _tune(plans: dict, gpu, budget_s, jobs, progress, log, compare_anchors: bool):
    from .tune.driver import tune_spec
    from .tune.measure import gpu_measurement
    from .tune.report import table

    specs = list(dict.fromkeys(p.spec for p in plans.values()))
    share = None if budget_s is None else budget_s / len(specs)
    best: dict[GDNSpec, tuple[KernelPlan, dict]] = {}
    for spec in specs:
        measurement = gpu_measurement(jobs, anchors=("fla", "flashqla") if compare_anchors else ())
        result = tune_spec(spec, gpu.name, budget_s=share, jobs=jobs, progress=progress, measurement=measurement)
        log(table(result))
        record = _tuning_record(result)
        chosen = result.best_plan or default_plan(spec)
        if result.best_plan is None:
            record["note"] = "no config passed the oracle and timed: default tiles kept"
        best[spec] = (chosen, record)
    new_plans = {h: best[p.spec][0] for h, p in plans.items()}
    tuning = {plan: record for plan, record in best.values()}
    return new_plans, tuning
