"""Build rendered .cu files into shared libraries with ninja driving nvcc.

One ninja file per build folder, one `nvcc -shared` edge per plan, so ninja runs several
plans at once and, with nvcc's depfile (`deps = gcc`), rebuilds only what a source, header or
flag change touches. nvcc's output (ptxas -v resource lines, warnings, errors) goes to a log
file per plan: the resource report on success, the error message on failure.

nvcc runs its sub-steps through its own `sh -c` with paths unquoted, so a path holding shell
metacharacters or whitespace is refused before ninja starts (UnsafePathError). The link strips
the static symbol table: it names nvcc's temporary files, which carry nvcc's process id, and
without it two builds of one source give the same bytes (`flashqla-tune verify` relies on it).
ninja runs under a small supervisor, in a POSIX session of its own (setsid), that kills ninja and every
compiler beneath it when the building process dies, however it dies: no nvcc or cicc outlives
the build.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from . import environment
from .package_data import csrc_dir
from .render import write_if_changed

# Override the number of parallel nvcc processes (default: the machine's cores).
JOBS_ENV = "FLASHQLA_TUNE_BUILD_JOBS"
_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")


# Characters a POSIX shell expands or splits words at; nvcc's internal sh -c sees our paths unquoted.
_SHELL_UNSAFE = frozenset(" \t\n\r\"'`$\\;&|<>()*?[]{}!")


class UnsafePathError(ValueError):
    """A path that would reach nvcc's internal shell holds characters that shell would interpret."""


def check_shell_safe(path, what: str) -> None:
    """Raise UnsafePathError when `path` holds a shell metacharacter or whitespace."""
    found = sorted(set(str(path)) & _SHELL_UNSAFE)
    if found:
        raise UnsafePathError(f"{what} {str(path)!r} contains {''.join(found)!r}: nvcc passes paths unquoted to its "
                              f"own shell, which would expand or split them; use a folder without shell "
                              f"metacharacters or spaces (for the cache: FLASHQLA_TUNE_CACHE)")


class BuildError(RuntimeError):
    """nvcc (or ninja) failed; names each failing plan, its .cu file and nvcc's message."""

    def __init__(self, failures: list[tuple[str, Path, str]], message: str | None = None,
                 results: list | None = None):
        self.failures = failures
        self.results = results or []   # the jobs of the same run that did build
        if message is None:
            parts = [f"building plan {name} from {source} failed:\n{text.rstrip()}" for name, source, text in failures]
            message = "\n\n".join(parts)
        super().__init__(message)


@dataclass(frozen=True)
class BuildConfig:
    """How sources become libraries: target arch, extra nvcc flags, the csrc/ folder."""
    arch: str = "sm_90a"
    extra_flags: tuple[str, ...] = ("-DNDEBUG",)
    csrc: Path | None = None          # None: the shipped csrc/ package data

    def __post_init__(self) -> None:
        if not _ARCH_RE.match(self.arch):
            raise ValueError(f"BuildConfig.arch={self.arch!r} is not an nvcc arch like 'sm_90a'")
        if isinstance(self.extra_flags, str):
            raise ValueError(f"BuildConfig.extra_flags must be a sequence of flags, got the string "
                             f"{self.extra_flags!r}")

    @property
    def csrc_dir(self) -> Path:
        return Path(self.csrc).resolve() if self.csrc is not None else csrc_dir().resolve()

    def flags(self) -> list[str]:
        """nvcc flags that change the binary (the cache key covers exactly these)."""
        number = _ARCH_RE.match(self.arch).group(1) + _ARCH_RE.match(self.arch).group(2)
        return [f"-gencode=arch=compute_{number},code=sm_{number}", "-O3", "-std=c++17",
                "--expt-relaxed-constexpr", "-Xptxas", "-v", "-shared", "-Xcompiler", "-fPIC",
                # only csrc/gdn_abi.h's FQT_EXPORT functions leave the library (see there why)
                "-Xcompiler", "-fvisibility=hidden",
                # no static symbol table: it names nvcc's temporary files, whose names vary per build
                "-Xlinker", "--strip-all",
                *self.extra_flags]

    def include_dirs(self) -> list[Path]:
        return [self.csrc_dir, environment.cutlass_include_dir()]


@dataclass(frozen=True)
class BuildJob:
    """One library to build: a plan's name, its rendered .cu and where the .so goes."""
    name: str
    source: Path
    output: Path

    @property
    def log(self) -> Path:
        return self.output.with_suffix(".ptxas.txt")


@dataclass
class BuildResult:
    job: BuildJob
    seconds: float | None                 # wall time of its nvcc edge; None when ninja was idle
    resources: dict = field(default_factory=dict)
    headers: list[Path] = field(default_factory=list)  # every header nvcc read (from the deps log)


def find_ninja() -> list[str]:
    """The ninja of the `ninja` PyPI package (its BIN_DIR), else one on PATH, else `python -m ninja`."""
    try:
        import ninja

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return [str(candidate)]
    except (ImportError, AttributeError):
        pass
    if shutil.which("ninja"):
        return [shutil.which("ninja")]
    return [sys.executable, "-m", "ninja"]


@lru_cache(maxsize=None)
def host_compiler_version() -> str:
    """First line of the host C++ compiler's --version (nvcc uses g++ from PATH)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return "unknown"
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


@lru_cache(maxsize=None)
def nvcc_version_text() -> str:
    """nvcc --version in full (release and build id), for the cache key."""
    return environment.nvcc_version_output().strip()


def default_jobs(count: int) -> int:
    """Parallel nvcc processes: bounded by the cores (or FLASHQLA_TUNE_BUILD_JOBS) and the work."""
    env = os.environ.get(JOBS_ENV)
    if env:
        try:
            limit = int(env)
        except ValueError:
            raise ValueError(f"{JOBS_ENV}={env!r} is not an integer") from None
        if limit < 1:
            raise ValueError(f"{JOBS_ENV}={env!r} must be at least 1")
    else:
        limit = os.cpu_count() or 1
    return max(1, min(limit, count))


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:").replace("\n", "")


def _ninja_var(text: str) -> str:
    # A variable's value is used in a shell command: shell-quote it, then escape for ninja.
    return text.replace("$", "$$").replace("\n", "")


def ninja_file(jobs: list[BuildJob], config: BuildConfig) -> str:
    """The build.ninja text for these jobs (absolute paths; deterministic)."""
    nvcc = shlex.quote(str(environment.find_nvcc()))
    flags = " ".join(shlex.quote(f) for f in config.flags())
    includes = " ".join(shlex.quote(f"-I{d}") for d in config.include_dirs())
    lines = [
        "# Generated by flashqla_tune.build; rewritten only when it changes.",
        "ninja_required_version = 1.5",
        f"nvcc = {_ninja_var(nvcc)}",
        f"flags = {_ninja_var(flags)}",
        f"includes = {_ninja_var(includes)}",
        "",
        # The old .so goes first so a failed edge leaves none behind (the caller tells success
        # by the output); the log keeps ptxas -v on success and is printed on failure.
        "rule nvcc_shared",
        "  command = rm -f $out && $nvcc $flags $includes -MD -MF $out.d -MT $out -o $out $in "
        "> $log 2>&1 || { cat $log; exit 1; }",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $name",
        "",
    ]
    for job in jobs:
        lines += [
            f"build {_ninja_escape(str(job.output))} | {_ninja_escape(str(job.log))}: "
            f"nvcc_shared {_ninja_escape(str(job.source))}",
            f"  log = {_ninja_var(shlex.quote(str(job.log)))}",
            f"  name = {_ninja_var(job.name)}",
        ]
    return "\n".join(lines) + "\n"


# ptxas -v prints, per function: "Compiling entry function 'X' for 'sm_90a'" (kernels only),
# "Function properties for X", "N bytes stack frame, N bytes spill stores, N bytes spill loads",
# "Used N registers, used N barriers, N bytes smem, N bytes cmem[0]".
_FUNC_RE = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_ENTRY_RE = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"ptxas info\s*: Used (\d+) registers")
_USED_PART_RE = re.compile(r"(\d+) (barriers|bytes smem|bytes cmem\[\d+\])")
# ptxas falls back to waiting after every wgmma when it cannot prove the asynchronous pipeline
# safe (advisory C7514 and relatives): correct, but the tensor cores then run one GEMM at a time.
_SERIALIZED_RE = re.compile(r"wgmma\.mma_async instructions are serialized due to (.*?) in the function '([^']+)'")


def parse_ptxas_report(text: str) -> dict:
    """Per function: registers, barriers, smem (static bytes), stack frame, spill stores/loads.

    Keys are the (mangled) symbol names; `entry` is True for kernels. Functions ptxas lists
    without a "Used" line (non-inlined device functions) carry only frame and spill numbers.
    A function whose wgmma ptxas serialized carries `wgmma_serialized` (ptxas's reason).
    """
    functions: dict[str, dict] = {}
    current: str | None = None
    for line in text.splitlines():
        if m := _SERIALIZED_RE.search(line):
            functions.setdefault(m.group(2), {}).setdefault("entry", True)
            functions[m.group(2)]["wgmma_serialized"] = m.group(1).strip()
        elif m := _ENTRY_RE.search(line):
            current = m.group(1)
            functions.setdefault(current, {})["entry"] = True
        elif m := _FUNC_RE.search(line):
            current = m.group(1)
            functions.setdefault(current, {}).setdefault("entry", False)
        elif (m := _FRAME_RE.search(line)) and current is not None:
            functions[current].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                       spill_loads=int(m.group(3)))
        elif (m := _USED_RE.search(line)) and current is not None:
            info = functions[current]
            info["registers"] = int(m.group(1))
            tail = line[m.end():]
            for value, what in _USED_PART_RE.findall(tail):
                if what == "barriers":
                    info["barriers"] = int(value)
                elif what == "bytes smem":
                    info["smem"] = int(value)
                else:
                    info.setdefault("cmem", {})[what.split()[-1]] = int(value)
    return functions


def _run_ninja(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*find_ninja(), *args], cwd=cwd, capture_output=True, text=True)


# Runs ninja (argv[2:]) as its child and exits with ninja's status. ninja starts each command in
# a process group of its own, so no single group holds the compilers: on Linux this supervisor
# makes itself the subreaper of everything beneath it (PR_SET_CHILD_SUBREAPER) and asks for
# SIGTERM when the building process dies (PR_SET_PDEATHSIG; checked against a parent that died
# first). On SIGTERM, SIGINT or SIGHUP it kills ninja, then every process reparented to it, until
# none is left: nvcc, cicc and ptxas end with the build. Elsewhere it kills its own group.
_SUPERVISOR = r"""
import ctypes, os, signal, subprocess, sys, time
parent, child = int(sys.argv[1]), None
linux = sys.platform.startswith("linux") and os.path.isdir("/proc")

def beneath():
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/" + entry + "/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.append(int(entry))
    return found

def end(signum, frame):
    if child is not None:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if linux:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            pids = beneath()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
    else:
        os.killpg(0, signal.SIGKILL)
    os._exit(128 + (signum or signal.SIGTERM))

for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, end)
if linux:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)                # PR_SET_CHILD_SUBREAPER
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:
    end(signal.SIGTERM, None)
child = subprocess.Popen(sys.argv[2:])
sys.exit(child.wait())
"""


def _run_ninja_supervised(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ninja so that it and every compiler it starts end with this process: under _SUPERVISOR,
    in a new POSIX session (setsid; a terminal's Ctrl-C reaches this process, which ends the build), which
    ends them when this process dies, SIGKILL included, or when the wait here is interrupted."""
    cmd = [sys.executable, "-c", _SUPERVISOR, str(os.getpid()), *find_ninja(), *args]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        _end_supervisor(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _end_supervisor(proc: subprocess.Popen) -> None:
    proc.terminate()   # the supervisor kills what is beneath it, then exits
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _edge_seconds(build_dir: Path, outputs: set[str]) -> dict[str, float]:
    # .ninja_log lines: start_ms, end_ms, mtime, output, command hash; the last record wins.
    seconds: dict[str, float] = {}
    log = build_dir / ".ninja_log"
    if not log.is_file():
        return seconds
    for line in log.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[3] in outputs:
            seconds[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    return seconds


def recorded_headers(build_dir: Path, output: Path) -> list[Path]:
    """The headers nvcc reported for one output, from ninja's deps log (`ninja -t deps`)."""
    proc = _run_ninja(["-C", str(build_dir), "-t", "deps", str(output)], build_dir)
    if proc.returncode != 0:
        return []
    paths = [Path(line.strip()) for line in proc.stdout.splitlines()[1:] if line.startswith("    ")]
    return [p for p in paths if p.suffix != ".cu"]


def build(jobs: list[BuildJob], build_dir: Path, config: BuildConfig | None = None,
          max_jobs: int | None = None) -> list[BuildResult]:
    """Build every job with one ninja run in build_dir; raise BuildError listing failures.

    Jobs that succeed keep their outputs even when others fail (callers may publish them:
    BuildError.results holds them). An up-to-date job is not rebuilt (seconds is None).
    """
    config = config or BuildConfig()
    if not jobs:
        return []
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate plan names in one build: {sorted(n for n in names if names.count(n) > 1)}")
    build_dir = Path(build_dir).resolve()
    jobs = [BuildJob(j.name, Path(j.source).resolve(), Path(j.output).resolve()) for j in jobs]
    check_shell_safe(build_dir, "build folder")
    for job in jobs:
        check_shell_safe(job.source, f"plan {job.name}'s source")
        check_shell_safe(job.output, f"plan {job.name}'s library")
    check_shell_safe(environment.find_nvcc(), "nvcc")
    for folder in config.include_dirs():
        check_shell_safe(folder, "include folder")
    build_dir.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        if not job.source.is_file():
            raise BuildError([(job.name, job.source, "the rendered source file does not exist")])
        job.output.parent.mkdir(parents=True, exist_ok=True)
    write_if_changed(build_dir / "build.ninja", ninja_file(jobs, config))
    parallel = max_jobs if max_jobs is not None else default_jobs(len(jobs))
    before = {str(j.output): (j.output.stat().st_mtime_ns if j.output.exists() else None) for j in jobs}
    # -k 0: keep going, so one plan's compile error does not hide another plan's result.
    proc = _run_ninja_supervised(["-C", str(build_dir), "-f", "build.ninja", "-k", "0", "-j", str(parallel)],
                                 build_dir)
    seconds = _edge_seconds(build_dir, {str(j.output) for j in jobs})
    results, failures = [], []
    for job in jobs:
        log_text = job.log.read_text(errors="replace") if job.log.is_file() else ""
        if not job.output.is_file():
            message = log_text.strip() or proc.stdout.strip() or proc.stderr.strip() or "nvcc produced no output"
            failures.append((job.name, job.source, message))
            continue
        rebuilt = before[str(job.output)] != job.output.stat().st_mtime_ns
        results.append(BuildResult(job, seconds.get(str(job.output)) if rebuilt else None,
                                   parse_ptxas_report(log_text), recorded_headers(build_dir, job.output)))
    if failures:
        raise BuildError(failures, results=results)
    if proc.returncode != 0:
        # Every output exists yet ninja failed: a ninja-level problem (bad file, missing tool).
        raise BuildError([(j.name, j.source, proc.stdout + proc.stderr) for j in jobs])
    return results


__all__ = ["BuildConfig", "BuildError", "BuildJob", "BuildResult", "UnsafePathError", "build", "check_shell_safe",
           "default_jobs", "find_ninja", "host_compiler_version", "ninja_file", "nvcc_version_text",
           "parse_ptxas_report", "recorded_headers"]
