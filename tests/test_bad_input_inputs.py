"""Bad inputs refused where they enter, naming the value: checkpoint configs, calibrate's flags,
output folder and corpus, the calibration artifact (alone and inside a pack), and the op's host
checks. Everything here is refused before a calibration, a compile or a GPU call would start, so
the checkpoints are tiny folders (a config.json, or a few small safetensors tensors)."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashqla_tune.calibrate.corpus import CorpusWarning, read_corpus
from flashqla_tune.calibrate.pipeline import check_out_dir
from flashqla_tune.calibrate.weights import INDEX_NAME, WeightIndex
from flashqla_tune.calibration_artifact import load_calibration, save_calibration
from flashqla_tune.calibration_settings import CalibrationError, CalibrationSettings
from flashqla_tune.cli import build_parser, main
from flashqla_tune.cli.compile import specs_for
from flashqla_tune.files import sha256_file
from flashqla_tune.ops import _check_offsets, check_scale, check_shapes_and_types, chunk_gated_delta_rule
from flashqla_tune.supported_shapes import MAX_WINDOW_CHUNKS, SUPPORTED, UnsupportedShapeError

sys.path.insert(0, str(Path(__file__).parent))
from pack_doubles import FakeLibraryOpener, edit_manifest, make_pack, synthetic_calibration  # noqa: E402
from test_cli_help import tiny_checkpoint  # noqa: E402

bad_input = pytest.mark.bad_input


def cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


# --- checkpoint config ------------------------------------------------------------------------

def config_list_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps([{"model_type": "qwen3_next"}]))
    return folder


@bad_input("info:config_list", "calibrate:config_list")
@pytest.mark.parametrize("command", ["info", "calibrate", "compile", "build"])
def test_a_config_that_is_not_an_object_is_named(command, tmp_path, capsys):
    ckpt = config_list_checkpoint(tmp_path / "ckpt")
    extra = {"calibrate": ["--out", str(tmp_path / "out")], "build": ["--out", str(tmp_path / "pack"), "--no-tune"]}
    rc, err = cli(capsys, command, str(ckpt), *extra.get(command, []))
    assert rc == 2 and "config.json holds a JSON list, not an object" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "pack").exists()


@bad_input("info:heads_float", "info:heads_bool", "info:heads_huge")
@pytest.mark.parametrize("changes, named", [
    ({"linear_num_key_heads": 2.7}, "linear_num_key_heads=2.7 must be a positive integer"),
    ({"linear_num_key_heads": True}, "linear_num_key_heads=True must be a positive integer"),
    ({"linear_num_value_heads": 0}, "linear_num_value_heads=0 must be a positive integer"),
    ({"linear_num_value_heads": -8}, "linear_num_value_heads=-8 must be a positive integer"),
    ({"linear_num_key_heads": 2 ** 40, "linear_num_value_heads": 2 ** 43},
     f"Hqk={2 ** 40} exceeds the {SUPPORTED.max_heads} heads"),
])
@pytest.mark.parametrize("command", ["info", "compile", "calibrate"])
def test_head_counts_must_be_positive_integers_within_the_table(command, changes, named, tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", **changes)
    extra = ["--out", str(tmp_path / "out")] if command == "calibrate" else []
    rc, err = cli(capsys, command, str(ckpt), *extra)
    assert rc == 2 and named in err, err
    assert not (tmp_path / "out").exists()


@bad_input("info:dtype_float32", "calibrate:dtype_float32")
@pytest.mark.parametrize("command", ["info", "compile", "build", "calibrate"])
def test_a_float32_checkpoint_is_refused_naming_its_dtype(command, tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", torch_dtype="float32")
    extra = {"calibrate": ["--out", str(tmp_path / "out")], "build": ["--out", str(tmp_path / "pack"), "--no-tune"]}
    rc, err = cli(capsys, command, str(ckpt), *extra.get(command, []))
    assert rc == 2 and "the checkpoint's dtype is 'float32'" in err and "--dtype bfloat16" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "pack").exists()


@bad_input("info:dtype_float32", "calibrate:dtype_float32")
def test_dtype_says_what_to_build_for_a_float32_checkpoint(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", torch_dtype="float32")
    specs = specs_for(build_parser().parse_args(["compile", str(ckpt), "--dtype", "float16"]))
    assert {s.qkv_dtype for s in specs} == {"float16"}
    from flashqla_tune.cli.calibrate import check_checkpoint_form

    check_checkpoint_form(ckpt, "bfloat16")   # calibrate --dtype bfloat16 passes the config check
    with pytest.raises(UnsupportedShapeError, match="'float32'"):
        check_checkpoint_form(ckpt, None)


@bad_input("calibrate:dtype_float32")
def test_calibrating_a_float32_checkpoint_records_the_dtype_asked_for(tmp_path):
    from fixtures.calibrate_tiny import make_qwen35, write_corpus
    from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

    make_qwen35(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["dtype"] == "float32"
    res = calibrate_checkpoint(tmp_path / "ck", write_corpus(tmp_path / "c.txt", n_bytes=4000), seq_len=256,
                               max_sequences=2, progress=False, write=False, qkv_dtype="float16")
    assert res.calibration.spec["qkv_dtype"] == "float16"


@bad_input("compile --hqk 2^31 --hv 2^31 (overflows the template's int)")
def test_compile_heads_beyond_the_table_are_a_spec_error(capsys):
    rc, err = cli(capsys, "compile", "--hqk", str(2 ** 31), "--hv", str(2 ** 31))
    assert rc == 2 and f"--hqk {2 ** 31} --hv {2 ** 31}: q/k heads Hqk={2 ** 31} exceeds the 65535" in err, err
    with pytest.raises(UnsupportedShapeError, match="Hv=70000 exceeds"):
        specs_for(build_parser().parse_args(["compile", "--hqk", "2", "--hv", "70000"]))


# --- safetensors shards -----------------------------------------------------------------------

def shards(folder: Path) -> Path:
    folder.mkdir()
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(3)}, str(folder / "model.safetensors"))
    save_file({"a.weight": torch.full((2,), 20.0)}, str(folder / "shadow.safetensors"))
    return folder


@bad_input("calibrate:shadow_shard")
def test_a_tensor_in_two_shards_is_an_error(tmp_path):
    ckpt = shards(tmp_path / "ckpt")
    with pytest.raises(CalibrationError, match=r"tensor 'a\.weight' is in two weight files, .*model\.safetensors "
                                               r"and .*shadow\.safetensors"):
        WeightIndex(ckpt)


@bad_input("calibrate:shadow_shard")
def test_the_shard_index_decides_where_each_tensor_lives(tmp_path):
    ckpt = shards(tmp_path / "ckpt")
    index = ckpt / INDEX_NAME
    index.write_text(json.dumps({"weight_map": {"a.weight": "model.safetensors", "b.weight": "model.safetensors"}}))
    weights = WeightIndex(ckpt)
    assert weights.location == {"a.weight": ckpt / "model.safetensors", "b.weight": ckpt / "model.safetensors"}
    assert weights.load(["a.weight"])["a.weight"].tolist() == [0.0, 0.0]
    index.write_text(json.dumps({"weight_map": {"a.weight": "shadow.safetensors", "b.weight": "shadow.safetensors"}}))
    with pytest.raises(CalibrationError, match=r"places 1 tensor\(s\) in shards that do not hold them, e\.g\. "
                                               r"'b\.weight' in shadow\.safetensors"):
        WeightIndex(ckpt)
    index.write_text(json.dumps({"weight_map": {"a.weight": "missing.safetensors"}}))
    with pytest.raises(CalibrationError, match="names shard 'missing.safetensors', which is not a file"):
        WeightIndex(ckpt)
    index.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="has no weight_map object"):
        WeightIndex(ckpt)


# --- calibrate's flags and output folder -------------------------------------------------------

@bad_input("flag:max-window=1e9")
@pytest.mark.parametrize("command", ["calibrate", "build"])
def test_max_window_is_bounded_by_the_kernels_cap_before_calibrating(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "cache"))
    out = ["--out", str(tmp_path / "out")] + (["--no-tune"] if command == "build" else [])
    rc, err = cli(capsys, command, *out, "--max-window", "1000000000")
    assert rc == 2 and f"max window N=1000000000 exceeds the kernels' window cap of {MAX_WINDOW_CHUNKS}" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    assert CalibrationSettings(max_window=MAX_WINDOW_CHUNKS).max_window == MAX_WINDOW_CHUNKS


def test_the_window_cap_is_the_one_the_warmup_tables_enforce():
    from flashqla_tune import warmup_tables

    assert warmup_tables.MAX_WINDOW_CHUNKS == MAX_WINDOW_CHUNKS


@bad_input("flag:max-sequences=0", "flag:max-sequences=-1", "flag:batch-size=0", "flag:batch-size=-2",
           "flag:seq-len=0")
@pytest.mark.parametrize("flag, value", [("--max-sequences", "0"), ("--max-sequences", "-1"),
                                         ("--batch-size", "0"), ("--batch-size", "-2"), ("--seq-len", "0")])
@pytest.mark.parametrize("command", ["calibrate", "build"])
def test_sizes_are_refused_by_flag_name(command, flag, value, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")] + (["--no-tune"] if command == "build" else [])
    rc, err = cli(capsys, command, *out, flag, value)
    assert rc == 2 and f"{flag}={value} must be positive" in err, err
    assert not (tmp_path / "out").exists()


@bad_input("flag:seq-len=0", "flag:max-sequences=0", "flag:batch-size=0")
@pytest.mark.parametrize("option", ["seq_len", "max_sequences", "batch_size"])
def test_the_calibration_api_refuses_sizes_too(option, tmp_path):
    from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

    with pytest.raises(CalibrationError, match=f"{option}=0 must be a positive integer"):
        calibrate_checkpoint(tmp_path / "missing", out_dir=tmp_path / "out", progress=False, **{option: 0})


@bad_input("flag:device=cuda")
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_clearly(tmp_path, capsys):
    rc, err = cli(capsys, "calibrate", "--out", str(tmp_path / "out"), "--device", "cuda")
    assert rc == 2 and "--device cuda: this machine has no CUDA device" in err and "--device cpu" in err, err
    rc, err = cli(capsys, "calibrate", "--out", str(tmp_path / "out"), "--device", "tpu")
    assert rc == 2 and "--device 'tpu' is not a device" in err, err


@bad_input("outdir:out_is_a_file", "outdir:out_is_a_nonjson_file")
@pytest.mark.parametrize("name, content", [("out_is_file.json", '{"mine": 1}'), ("out_is_file.txt", "notes")])
def test_out_that_is_a_file_is_refused_before_calibrating(name, content, tmp_path, capsys):
    target = tmp_path / name
    target.write_text(content)
    rc, err = cli(capsys, "calibrate", "--out", str(target), "--no-progress")
    assert rc == 2 and f"--out {target} is a file, not a folder" in err, err
    assert target.read_text() == content


@bad_input("outdir:unrelated_files")
@pytest.mark.parametrize("name", ["calibration.md", "calibration.json", "calibration.png"])
def test_a_users_own_calibration_files_are_not_overwritten(name, tmp_path, capsys):
    out = tmp_path / "unrelated"
    out.mkdir()
    (out / name).write_text("my own notes")
    (out / "other.txt").write_text("kept")
    rc, err = cli(capsys, "calibrate", "--out", str(out), "--no-progress")
    assert rc == 2 and f"{out / name} is not part of a flashqla-tune calibration" in err and "--force" in err, err
    assert (out / name).read_text() == "my own notes" and (out / "other.txt").read_text() == "kept"
    check_out_dir(out, force=True)      # --force: the user said so


@bad_input("outdir:unrelated_files")
def test_our_own_calibration_files_may_be_replaced(tmp_path):
    out = tmp_path / "ours"
    save_calibration(synthetic_calibration(), out / "calibration.json")
    (out / "calibration.md").write_text("the report written with it")
    check_out_dir(out)
    check_out_dir(tmp_path / "fresh")   # a folder that does not exist yet
    (out / "calibration.json").write_text(json.dumps({"schema": "someone-else"}))
    with pytest.raises(CalibrationError, match="is not part of a flashqla-tune calibration"):
        check_out_dir(out)


# --- corpus -----------------------------------------------------------------------------------

@bad_input("corpus:/dev/null")
def test_a_corpus_that_is_not_a_regular_file_gets_the_right_message(tmp_path, capsys):
    rc, err = cli(capsys, "calibrate", "--corpus", "/dev/null", "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2 and "corpus /dev/null is not a regular file or a folder" in err, err
    assert not (tmp_path / "out").exists()


@bad_input("corpus:garbage.bin", "corpus:nul.txt")
@pytest.mark.parametrize("name, data", [("garbage.bin", bytes(range(256)) * 64), ("nul.txt", b"\0" * 4096),
                                        ("high_bytes.dat", bytes(range(128, 256)) * 32)],
                         ids=["garbage.bin", "nul.txt", "high_bytes.dat"])
def test_a_binary_corpus_is_refused_and_skipped_in_a_folder(name, data, tmp_path):
    path = tmp_path / "corpora" / name
    path.parent.mkdir()
    path.write_bytes(data)
    with pytest.raises(CalibrationError, match=f"corpus {re.escape(str(path))} .*a binary file, not text"):
        read_corpus(path)
    (path.parent / "good.txt").write_text("plain text " * 50)
    path.rename(path.with_suffix(".txt"))
    with pytest.warns(CorpusWarning, match=f"{re.escape(str(path.with_suffix('.txt')))} .*a binary file, skipped"):
        texts = read_corpus(path.parent)
    assert [n for n, _ in texts] == ["good.txt"]


@bad_input("corpus:latin1.txt")
def test_non_utf8_text_gets_a_warning_naming_the_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Café au lait, crème brûlée, naïve façade. ".encode("latin-1") * 40)
    with pytest.warns(CorpusWarning, match=f"corpus file {re.escape(str(path))} is not UTF-8 text"):
        ((_, text),) = read_corpus(path)
    assert "caf" in text.lower() and "\ufffd" in text


# --- the calibration artifact -----------------------------------------------------------------

def artifact(tmp_path: Path, change) -> Path:
    """synthetic_calibration (3 layers of 8 v-heads, N = 16) saved, then edited by change(data)."""
    path = save_calibration(synthetic_calibration(), tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def warm_head(data, layer=0, head=0, n_h=1):
    h = data["layers"][layer]["heads"][head]
    h["class"], h["n_h"] = "warmup", n_h


ARTIFACT_CASES = [
    ("n_h -7 (class warmup)", lambda d: warm_head(d, n_h=-7),
     r"layers\[0\]\.heads\[0\]\.n_h is -7: it must be 1\.\.16"),
    ("n_h 0", lambda d: warm_head(d, n_h=0), r"layers\[0\]\.heads\[0\]\.n_h is 0: it must be 1\.\.16"),
    ("n_h 5000 (> N=16, > 1024)", lambda d: warm_head(d, n_h=5000), r"heads\[0\]\.n_h is 5000: it must be 1\.\.16"),
    ("n_h 2.9 (float)", lambda d: warm_head(d, n_h=2.9), r"heads\[0\]\.n_h is 2\.9: it must be an integer"),
    ("n_h '3' (string)", lambda d: warm_head(d, n_h="3"), r"heads\[0\]\.n_h is '3': it must be an integer"),
    ("n_h true (bool)", lambda d: warm_head(d, n_h=True), r"heads\[0\]\.n_h is True: it must be an integer"),
    ("layers []", lambda d: d.update(layers=[]), r"layers is \[\]: a calibration has at least one GDN layer"),
    ("layer 0 heads []", lambda d: d["layers"][0].update(heads=[]),
     r"layers\[0\]\.heads holds 0 heads, but the spec has num_v_heads=8"),
    ("layer 1 has 4 heads, layer 0 has 8", lambda d: d["layers"][1].update(heads=d["layers"][1]["heads"][:4]),
     r"layers\[1\]\.heads holds 4 heads, but the spec has num_v_heads=8"),
    ("settings max_window 4 but n_h 9", lambda d: (d["settings"].update(max_window=4), warm_head(d, n_h=9)),
     r"heads\[0\]\.n_h is 9: it must be 1\.\.4"),
    ("spec says Hv=16, layers have 8 heads", lambda d: d["checkpoint"]["spec"].update(num_v_heads=16),
     r"layers\[0\]\.heads holds 8 heads, but the spec has num_v_heads=16"),
    (None, lambda d: [h.update(head=0) for layer in d["layers"] for h in layer["heads"]],
     r"layers\[0\]\.heads\[1\]\.head is 0: it must be 1"),
]


@pytest.mark.parametrize("case, change, named", [
    pytest.param(*c, marks=bad_input(c[0]) if c[0] else (), id=c[0] or "every head index 0") for c in ARTIFACT_CASES])
def test_every_artifact_field_is_checked_on_load_naming_file_and_field(case, change, named, tmp_path):
    path = artifact(tmp_path, change)
    with pytest.raises(CalibrationError, match=f"{re.escape(str(path))} is a damaged calibration artifact: .*{named}"):
        load_calibration(path)


@pytest.mark.parametrize("change, named", [
    (lambda d: d["settings"].update(max_window="16"), r"settings: max window N must be an int >= 1, got '16'"),
    (lambda d: d["settings"].update(max_window=5000), r"settings: max window N=5000 exceeds the kernels' window cap"),
    (lambda d: d["settings"].pop("eps"), r"settings: settings lack eps"),
    (lambda d: d["layers"][0]["heads"][0].update(zero_decay_fraction=3.0), r"zero_decay_fraction is 3\.0"),
    (lambda d: d["layers"][0]["heads"][0].update(above_fraction=[0.5]), r"above_fraction holds 1 values"),
    (lambda d: d["layers"][2].update(layer=7), r"layers\[2\]\.layer is 7: it must be 2"),
    (lambda d: d["checkpoint"]["spec"].update(num_v_heads=7), r"checkpoint\.spec: GDNSpec\.num_v_heads=7"),
    (lambda d: d.update(layers={"0": []}), r"layers is dict"),
], ids=["max_window string", "max_window 5000", "no eps", "zero_decay_fraction 3", "above_fraction short",
        "layer index 7", "spec Hv 7 of Hqk 2", "layers a dict"])
def test_settings_and_tables_are_checked_against_the_schema(change, named, tmp_path):
    path = artifact(tmp_path, change)
    with pytest.raises(CalibrationError, match=f"{re.escape(str(path))} is a damaged calibration artifact: .*{named}"):
        load_calibration(path)


def test_a_valid_artifact_still_loads_with_exact_and_warmup_heads(tmp_path):
    cal = load_calibration(artifact(tmp_path, lambda d: warm_head(d, 1, 5, 16)))
    assert cal.layers[1].heads[5].n_h == 16 and len(cal.model_table()) == 8


PACK_CASES = [
    ("calibration: n_h -7 (class warmup) (re-signed)", lambda d: warm_head(d, n_h=-7), r"n_h is -7"),
    ("calibration: n_h 0 (re-signed)", lambda d: warm_head(d, n_h=0), r"n_h is 0"),
    ("calibration: n_h 5000 (> max_window 16, > 1024) (re-signed)", lambda d: warm_head(d, n_h=5000), "n_h is 5000"),
    ("calibration: n_h 2.9 (float) (re-signed)", lambda d: warm_head(d, n_h=2.9), r"n_h is 2\.9"),
    ("calibration: n_h 2^40 (re-signed)", lambda d: warm_head(d, n_h=2 ** 40), f"n_h is {2 ** 40}"),
    ("calibration: every head index 0 (re-signed)",
     lambda d: [h.update(head=0) for layer in d["layers"] for h in layer["heads"]], r"heads\[1\]\.head is 0"),
    ("calibration: layers [] and manifest num_gdn_layers 0 (re-signed)", lambda d: d.update(layers=[]),
     r"layers is \[\]"),
]


@pytest.mark.parametrize("case, change, named", [pytest.param(*c, marks=bad_input(c[0]), id=c[0]) for c in PACK_CASES])
def test_a_packs_calibration_is_refused_at_load_naming_the_packs_file(case, change, named, tmp_path):
    import flashqla_tune
    from flashqla_tune.pack import PackError

    pack = make_pack(tmp_path / "pack", tp_sizes=(1,))
    path = pack / "calibration.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))

    edit_manifest(pack, lambda m: m["calibration"].update(sha256=sha256_file(path)))  # re-signed
    opener = FakeLibraryOpener()
    with pytest.raises(PackError, match=f"{re.escape(str(path))} is a damaged calibration artifact: .*{named}"):
        flashqla_tune.load(pack, 0, 1, gpu=None, open_library=opener)
    if case.startswith("calibration: layers []"):   # and the manifest's num_gdn_layers 0: its own check
        edit_manifest(pack, lambda m: m["checkpoint"].update(num_gdn_layers=0))
        with pytest.raises(PackError, match="num_gdn_layers"):
            flashqla_tune.load(pack, 0, 1, gpu=None, open_library=opener)
    assert opener.opened == []


# --- the op's host checks ---------------------------------------------------------------------

def _inputs(T=8, hqk=2, hv=4, K=128, V=128):
    dt = torch.bfloat16
    return (torch.zeros(1, T, hqk, K, dtype=dt), torch.zeros(1, T, hqk, K, dtype=dt),
            torch.zeros(1, T, hv, V, dtype=dt), torch.zeros(1, T, hv), torch.zeros(1, T, hv))


@bad_input("scale=nan", "scale=inf")
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_a_non_finite_scale_is_refused_before_the_device_check(scale):
    with pytest.raises(ValueError, match=f"scale={scale!r} must be a finite number"):
        chunk_gated_delta_rule(*_inputs(), scale=scale)
    with pytest.raises(TypeError, match="scale must be a float or None"):
        check_scale("0.1")
    check_scale(0.125)
    check_scale(None)


@bad_input("cu_seqlens_cpu float list")
def test_cu_seqlens_cpu_must_hold_integers():
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu\[1\]=255\.7 is not an integer offset"):
        _check_offsets([0, 255.7], 2, 256)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu\[0\]=0\.0 is not an integer offset"):
        _check_offsets([0.0, 255], 2, 256)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold integer offsets, got a torch.float32 tensor"):
        _check_offsets(torch.tensor([0.0, 255.7]), 2, 256)
    q, k, v, g, b = _inputs(T=256)
    with pytest.raises(ValueError, match="not an integer offset"):
        chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.tensor([0, 255]), cu_seqlens_cpu=[0.0, 255.7])
    _check_offsets([0, 255], 2, 256)
    _check_offsets(torch.tensor([0, 255], dtype=torch.int32), 2, 256)


@bad_input("cu_seqlens ending before T (cpu copy)", "state_v_first with kv-shaped state (square K=V: undetectable)")
def test_the_inherent_cases_are_accepted_and_documented():
    q, k, v, g, b = _inputs(T=16)
    # offsets ending before T: rows past cu_seqlens[-1] belong to no sequence
    check_shapes_and_types(q, k, v, g, b, None, torch.tensor([0, 10]), [0, 10], False)
    # at K = V a [N,Hv,K,V] state has the shape of a [N,Hv,V,K] one
    check_shapes_and_types(q, k, v, g, b, torch.zeros(1, 4, 128, 128), None, None, True)
    doc = " ".join(chunk_gated_delta_rule.__doc__.split())
    assert "rows of o past cu_seqlens[-1] belong to no sequence and are left unwritten" in doc
    assert "state_v_first cannot be checked against initial_state there" in doc
