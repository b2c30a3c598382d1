"""flashqla-tune verify PACK: rebuild every kernel library of a pack from its recorded plans and
compare the bytes with the pack's.

The manifest records each library's plan (spec and tiles) and the toolchain that built it (nvcc,
CUTLASS, torch). Rendering a plan with this flashqla-tune's templates and building it with the
same toolchain and the default build flags gives the same bytes (the link drops the only part
that varies between builds, flashqla_tune.build says why), so a library that differs was not
built from its plan by this toolchain: a different tool version, a different toolchain (both
named in the report), or a replaced binary. --key also checks the pack's signature. The
prebuilt C++ host extension is not rebuilt (its bytes depend on the torch build and the host
compiler's environment); it is checked against its recorded sha256 only.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser("verify", help="rebuild a pack's kernel libraries from their plans and compare the bytes")
    p.add_argument("pack", help="pack folder")
    p.add_argument("--key", action="append", default=[], metavar="PUB",
                   help="also require a signature by this public key (repeatable: any of them)")
    p.add_argument("--jobs", type=int, help="parallel nvcc processes (default: cores)")
    p.add_argument("--keep", metavar="DIR", help="build in DIR and keep the rebuilt libraries there")
    return p


@dataclass(frozen=True)
class LibraryCheck:
    """One library of the pack against its rebuild."""
    so: str                 # path inside the pack
    plan_name: str
    pack_sha256: str
    rebuilt_sha256: str

    @property
    def identical(self) -> bool:
        return self.pack_sha256 == self.rebuilt_sha256


def build_with_nvcc(plans: list, work: Path, jobs: int | None = None, *, renderer=None, config=None) -> dict:
    """Render each plan (default: with the shipped templates) and build it (default: with the
    default BuildConfig, as a pack's build does) into `work`; returns {plan name: built .so path}."""
    from ..build import BuildConfig, BuildJob, build
    from ..render import Renderer

    renderer, build_jobs = renderer or Renderer(), []
    for plan in plans:
        folder = Path(work) / plan.name
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / f"{plan.name}.cu"
        source.write_text(renderer.render(plan))
        build_jobs.append(BuildJob(plan.name, source, folder / f"{plan.name}.so"))
    results = build(build_jobs, Path(work), config or BuildConfig(), max_jobs=jobs)
    return {r.job.name: r.job.output for r in results}


def rebuild_and_compare(pack, work: Path, build_libraries=None, jobs: int | None = None) -> list[LibraryCheck]:
    """Rebuild every kernel library the manifest lists (each once) with `build_libraries`
    (default build_with_nvcc) and compare it with the pack's file."""
    from ..files import sha256_file
    from ..pack import PackError, read_manifest

    pack = Path(pack)
    manifest = read_manifest(pack)
    by_so = {}
    for p in manifest.plans:
        by_so.setdefault(p.so, p.plan)
    for so in by_so:
        if not (pack / so).is_file():
            raise PackError(f"pack {pack} lacks binary {so}: nothing to compare its rebuild with")
    plans = list(dict.fromkeys(by_so.values()))
    built = (build_libraries or build_with_nvcc)(plans, Path(work), jobs)
    return [LibraryCheck(so, plan.name, sha256_file(pack / so), sha256_file(built[plan.name]))
            for so, plan in by_so.items()]


def toolchain_differences(recorded: dict) -> list[str]:
    """How this machine's nvcc and CUTLASS (and host compiler, where the manifest records one)
    differ from the ones the manifest records."""
    from .. import environment
    from ..build import host_compiler_version

    here = {"nvcc": environment.nvcc_version(), "cutlass": environment.cutlass_version()}
    if "host_compiler" in recorded:
        here["host_compiler"] = host_compiler_version()
    return [f"{name}: pack built with {recorded.get(name)!r}, this machine has {here[name]!r}"
            for name in here if str(recorded.get(name)) != here[name]]


def run(args) -> int:
    from .. import __version__
    from ..pack import read_manifest

    if args.jobs is not None and args.jobs <= 0:
        raise ValueError(f"--jobs={args.jobs} must be positive")
    pack = Path(args.pack)
    manifest = read_manifest(pack)
    if args.key:
        from ..pack_signing import verify_pack

        signed = verify_pack(pack, args.key, manifest)
        print(f"{pack}: signature by key {signed.key_id} matches the manifest and every file it covers")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="flashqla-tune-verify-"))
    try:
        checks = rebuild_and_compare(pack, work, jobs=args.jobs)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for c in checks:
        state = "identical" if c.identical else f"DIFFERS (pack {c.pack_sha256[:16]}, rebuilt {c.rebuilt_sha256[:16]})"
        print(f"  {c.so}: {state}")
    bad = [c for c in checks if not c.identical]
    if manifest.host_extension is not None:
        print(f"  {manifest.host_extension.so}: not rebuilt (host extension; checked by its recorded sha256 at load)")
    if not bad:
        print(f"{pack}: all {len(checks)} kernel libraries rebuild to identical bytes")
        return 0
    print(f"{pack}: {len(bad)} of {len(checks)} kernel libraries differ from their rebuild: "
          f"{', '.join(c.so for c in bad)}")
    hints = toolchain_differences(manifest.toolchain)
    if manifest.tool_version != __version__:
        hints.append(f"flashqla-tune: pack built by {manifest.tool_version}, this is {__version__} "
                     f"(its templates may differ)")
    if hints:
        print("  the toolchain differs, which may explain it: " + "; ".join(hints))
    return 1
