"""flashqla-tune cache ls|clear: the built-kernel cache (FLASHQLA_TUNE_CACHE moves it)."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("cache", help="list or clear built kernel libraries")
    actions = p.add_subparsers(dest="cache_action", required=True)
    ls = actions.add_parser("ls", help="list cache entries with their plan, size and resource use")
    ls.add_argument("--json", action="store_true", help="print JSON instead of text")
    clear = actions.add_parser("clear", help="remove cache entries")
    clear.add_argument("match", nargs="?", help="remove only entries whose folder name contains this text")
    return p


# Spill bytes (stores or loads, per kernel) a plan may have before `cache ls` flags it: the budget the
# compile tests hold the shipped plans to (tests/test_build_cache.py, SPILL_BUDGET_BYTES).
SPILL_FLAG_BYTES = 64


def _spills(resources: dict) -> int:
    """The largest spill (stores or loads, bytes) of any kernel in a ptxas report."""
    return max((max(r.get("spill_stores", 0), r.get("spill_loads", 0)) for r in resources.values() if r.get("entry")),
               default=0)


def _resource_summary(resources: dict) -> str:
    kernels = {name: r for name, r in resources.items() if r.get("entry")}
    if not kernels:
        return "-"
    regs = max(r.get("registers", 0) for r in kernels.values())
    spills = sum(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in kernels.values())
    if _spills(resources) > SPILL_FLAG_BYTES:
        return f"{regs} regs, SPILLS {spills} B (a kernel above {SPILL_FLAG_BYTES} B)"
    return f"{regs} regs, {spills} B spilled" if spills else f"{regs} regs, no spill"


def run(args) -> int:
    from .. import cache

    root = cache.kernels_dir()
    if args.cache_action == "clear":
        removed = cache.clear(match=args.match)
        what = f"entries matching {args.match!r}" if args.match else "entries"
        print(f"removed {removed} {what} from {root}")
        return 0
    entries = cache.list_entries()
    if args.json:
        print(json.dumps({"root": str(root), "entries": [
            {"path": str(e.path), "valid": e.valid, "problem": e.problem or None, "size_bytes": e.size_bytes,
             "plan_name": e.manifest.get("plan_name") if e.manifest else None,
             "key": e.manifest.get("key") if e.manifest else None,
             "build_seconds": e.manifest.get("build_seconds") if e.manifest else None,
             "resources": e.manifest.get("resources") if e.manifest else None,
             "spill_flagged": bool(e.manifest) and _spills(e.manifest.get("resources", {})) > SPILL_FLAG_BYTES}
            for e in entries]}, indent=2))
        return 0
    print(f"cache {root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    for e in entries:
        size = f"{e.size_bytes / 1e6:.1f} MB"
        if e.valid:
            m = e.manifest
            print(f"  {e.path.name}  {size}  built {m.get('created', '?')} in {m.get('build_seconds', 0):.1f} s  "
                  f"{_resource_summary(m.get('resources', {}))}")
        else:
            print(f"  {e.path.name}  {size}  INVALID ({e.problem}); rebuilt on next use")
    return 0
