"""flashqla-tune info [CHECKPOINT | PACK]: the environment and a checkpoint's GDN layers, or what a
kernel pack holds.

A folder with manifest.json is a pack, one with config.json (or a config.json file) a checkpoint.
A checkpoint is checked against the supported-shape table first, from config.json alone, so an
unsupported one is refused before anything else runs."""
from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser("info", help="show GPU, nvcc, CUTLASS and cache; with a checkpoint, its GDNSpec per layer; "
                                    "with a pack, its plans, TP degrees, tuning, calibration and target GPU")
    p.add_argument("path", nargs="?", metavar="CHECKPOINT|PACK",
                   help="checkpoint folder (or its config.json), or a kernel pack folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def is_pack(path: Path) -> bool:
    from ..pack import MANIFEST

    return path.is_dir() and (path / MANIFEST).is_file()


def run(args) -> int:
    path = Path(args.path) if args.path else None
    if path is not None and not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint or pack")
    if path is not None and is_pack(path):
        return _pack(path, args.json)
    if path is not None and path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} is neither a checkpoint (no config.json) nor a kernel pack (no manifest.json)")
    model = _checked_model(path) if path is not None else None
    return _environment_and_model(path, model, args.json)


def _checked_model(path: Path):
    from ..model_config import read_model_config
    from ..supported_shapes import check_checkpoint_dtype, check_model

    model = read_model_config(path)
    check_model(model, str(path))
    check_checkpoint_dtype(model, None, str(path))   # info has no --dtype: its spec would be a guess
    return model


def _environment_and_model(path, model, as_json: bool) -> int:
    from .. import environment

    env = environment.describe()
    if as_json:
        out = {"environment": env}
        if model is not None:
            out["model"] = {"family": model.family, "model_type": model.model_type,
                            "num_layers": model.num_layers, "gdn_layers": list(model.gdn_layers),
                            "spec": model.spec.to_dict(), "spec_name": model.spec.name,
                            "layer_call": _layer_call(model)}
        print(json.dumps(out, indent=2))
        return 0
    gpu = env["gpu"]
    print(f"torch     {env['torch']}")
    print("gpu       " + (f"{gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs, driver {gpu['driver']})"
                          if gpu else "none (kernels can be built here, not run)"))
    nvcc, cutlass = env["nvcc"], env["cutlass"]
    print("nvcc      " + (f"{nvcc['version']} at {nvcc['path']}" if "version" in nvcc else nvcc["error"]))
    print("cutlass   " + (f"{cutlass['version']} headers at {cutlass['include']}" if "version" in cutlass
                          else cutlass["error"]))
    print(f"cache     {env['cache']}")
    if model is not None:
        s = model.spec
        print(f"\ncheckpoint {path}: {model.family} ({model.model_type}), "
              f"{model.num_gdn_layers} GDN of {model.num_layers} layers")
        print(f"  spec {s.name}: Hqk={s.num_qk_heads} Hv={s.num_v_heads} K={s.head_k_dim} V={s.head_v_dim} "
              f"C={s.chunk_size} gate={s.gate_kind} qkv={s.qkv_dtype} state={s.state_layout} "
              f"beta<={s.beta_max} l2norm_in_kernel={s.qk_l2norm_in_kernel}")
        print(f"  layer call: {_layer_call(model)}")
        print("  layer  kind    spec")
        gdn = set(model.gdn_layers)
        for i in range(model.num_layers):
            print(f"  {i:5d}  {'GDN ' if i in gdn else 'attn'}    {s.name if i in gdn else '-'}")
    return 0


def _layer_call(model) -> str:
    """How the family's GDN layer calls the kernel (model_config's family record); the spec's state
    layout is the one that call holds its state in."""
    from ..model_config import family_named

    return family_named(model.family).layer_call()


def state_layout_text(layout: str) -> str:
    return f"{layout} ([N,Hv,V,K], state_v_first=True)" if layout == "vk" else f"{layout} ([N,Hv,K,V])"


def describe_pack(path: Path) -> dict:
    """What a pack holds (its manifest), whether its files check out, and its calibration's summary."""
    from ..calibration_artifact import load_calibration
    from ..calibration_settings import CalibrationError
    from ..pack import PackError, check_binaries, check_calibration, read_manifest
    from .calibrate import calibration_summary

    manifest = read_manifest(path, this_host=False)  # describes a pack of any host
    problems = []
    try:
        check_binaries(path, manifest)
    except PackError as exc:
        problems.append(str(exc))
    calibration = None
    try:
        calibration = calibration_summary(load_calibration(check_calibration(path, manifest),
                                                           manifest.checkpoint_sha256))
    except (PackError, CalibrationError) as exc:
        problems.append(str(exc))
    return {"pack": str(path), "target": manifest.target, "manifest": manifest.to_dict(),
            "calibration": calibration, "problems": problems}


def _pack(path: Path, as_json: bool) -> int:
    from ..pack import read_manifest
    from ..warmup_tables import describe_splits
    from .build import print_plans

    info = describe_pack(path)
    if as_json:
        print(json.dumps(info, indent=2))
        return 1 if info["problems"] else 0
    m = read_manifest(path, this_host=False)
    s = m.spec
    print(f"pack {path}: {m.target}, made by flashqla-tune {m.tool_version} on {m.created}")
    gpu = m.gpu
    print("  for      " + (f"{gpu['name']} ({gpu['arch']}, {gpu.get('sm_count', '?')} SMs, driver "
                           f"{gpu.get('driver', '?')}), tuned there" if m.tuned
                           else "any sm_90 GPU (default tiles, untuned)"))
    print(f"  model    {s.name}: Hqk={s.num_qk_heads} Hv={s.num_v_heads} K={s.head_k_dim} V={s.head_v_dim} "
          f"qkv={s.qkv_dtype} state={state_layout_text(s.state_layout)}, {m.num_gdn_layers} GDN layers")
    print(f"  checkpoint {m.checkpoint_sha256[:16]} ({m.checkpoint_path})")
    print(f"  toolchain nvcc {m.toolchain.get('nvcc')}, CUTLASS {m.toolchain.get('cutlass')}, "
          f"torch {m.toolchain.get('torch')}")
    print(f"  TP degrees {', '.join(str(t) for t in m.tp_sizes)}; plans (head form: native = the model's "
          f"heads per rank, qk_repeated = q/k repeated to Hv):")
    print_plans(m)
    tuned = [p for p in m.plans if p.tuning]
    for p in tuned:
        t = p.tuning
        print(f"    tp={p.tp_size} {p.form:<11} tuning: study {t.get('study')}, {t.get('trials')} trials, "
              f"stopped: {t.get('stopped')}")
    print("  context parallel:")
    for p in m.plans:
        if p.segment_chunks is not None:
            print(f"    tp={p.tp_size} {p.form:<11} {describe_splits(p.segment_chunks)}")
    host = m.host_extension
    print(f"  C++ host path: {host.so} (torch {host.torch}, {host.python_abi})" if host is not None
          else "  C++ host path: none (eager calls take the Python host path)")
    print_backward(m)
    cal = info["calibration"]
    if cal is not None:
        st, corpus = cal["settings"], cal["corpus"]
        print(f"  calibration: eps={st['eps']:g} Q={st['quantile']:g} N={st['max_window']} on "
              f"{corpus.get('num_tokens')} tokens of {corpus.get('name')}; model-wide table {cal['model_table']}")
        for layer in cal["layers"]:
            print(f"    {layer['summary']}")
    for problem in info["problems"]:
        print(f"  DAMAGED: {problem}")
    return 1 if info["problems"] else 0


def print_backward(m) -> None:
    """The pack's backward kernel libraries, one line per kind (backward.libraries.KINDS): its file,
    or why it carries none; one line in all where it carries none and these head dims have none."""
    from ..backward import libraries

    K, V = m.spec.head_k_dim, m.spec.head_v_dim
    if not m.backward and all(libraries.spec_for(kind, K, V) is None for kind in libraries.KINDS):
        print(f"  backward kernels: none for K={K}, V={V} (the backward runs in torch)")
        return
    print("  backward kernels:")
    for kind in libraries.KINDS:
        record = m.backward_library(kind)
        print(f"    {kind}: {record.so}" if record is not None else
              f"    {kind}: none ({describe_missing_backward(m, kind)})")


def describe_missing_backward(m, kind: str) -> str:
    """What a pack without the backward's `kind` library (backward.libraries.KINDS) does on a backward."""
    from ..backward import libraries

    if libraries.spec_for(kind, m.spec.head_k_dim, m.spec.head_v_dim) is None:
        return f"no {kind} kernels for these head dims: the backward runs that part in torch"
    return ("the pack was built without them: the first backward compiles them where nvcc is, else runs that "
            "part in torch; rebuild the pack to ship them")
