"""Artifact round trip, fail-closed loading, atomic writes and the checkpoint hash cache."""
import json
import os

import pytest
import torch

from flashqla_tune import files
from flashqla_tune.content_hash import HashCache, checkpoint_hash, corpus_hash
from flashqla_tune.calibrate.statistics import calibrate_gates
from flashqla_tune.calibration_artifact import Calibration, load_calibration, save_calibration
from flashqla_tune.calibration_settings import CalibrationError, CalibrationSettings


def make_calibration(sha="ab" * 32):
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i in range(2):
        g = -torch.rand(2, 1024, 4, generator=gen) * 0.3
        g[..., 0] = 0.0
        layers.append(calibrate_gates(g, layer=i, decoder_layer=2 * i))
    return Calibration(checkpoint_sha256=sha, checkpoint_path="/ckpt", family="qwen3_5", model_type="qwen3_5_text",
                       spec={"num_qk_heads": 1, "num_v_heads": 4}, settings=CalibrationSettings(),
                       corpus={"name": "c.txt", "sha256": "cd" * 32, "num_sequences": 2, "seq_len": 1024,
                               "num_tokens": 2048}, layers=layers)


def test_round_trip(tmp_path):
    cal = make_calibration()
    path = save_calibration(cal, tmp_path)
    back = load_calibration(path, checkpoint_sha256=cal.checkpoint_sha256)
    assert back.layers == cal.layers and back.settings == cal.settings and back.corpus == cal.corpus
    assert back.model_table() == [-1, *cal.model_table()[1:]] and back.model_table()[0] == -1
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["tool_version"] and data["settings"]["eps"] == 1e-5
    assert data["settings"]["max_window"] == 16 and data["settings"]["chunk_size"] == 64
    assert data["layers"][1]["decoder_layer"] == 2 and data["layers"][0]["heads"][0]["class"] == "exact"


def test_wrong_checkpoint_names_both(tmp_path):
    path = save_calibration(make_calibration(sha="11" * 32), tmp_path)
    with pytest.raises(CalibrationError, match=r"calibrated for checkpoint 1111.*not for this checkpoint 2222"):
        load_calibration(path, checkpoint_sha256="22" * 32)


def test_unknown_schema_and_damage(tmp_path):
    path = save_calibration(make_calibration(), tmp_path)
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="schema version 99"):
        load_calibration(path)
    path.write_text('{"schema": "something-else"}')
    with pytest.raises(CalibrationError, match="not a flashqla-tune calibration"):
        load_calibration(path)
    path.write_text('{"schema": "flashqla-tune.calibration", "schema_ver')
    with pytest.raises(CalibrationError, match="damaged"):
        load_calibration(path)
    data["schema_version"] = 1
    del data["layers"][0]["heads"][1]["n_h"]
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="damaged"):
        load_calibration(path)
    with pytest.raises(CalibrationError, match="no calibration artifact"):
        load_calibration(tmp_path / "missing.json")


def test_atomic_write_keeps_old_content_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "calibration.json"
    target.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError):
        save_calibration(make_calibration(), target)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json"]   # no temp file left


def write_checkpoint(root):
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    (root / "model-00001.safetensors").write_bytes(b"a" * 1000)
    (root / "model-00002.safetensors").write_bytes(b"b" * 1000)
    return root


def test_checkpoint_hash_is_cached_by_size_and_mtime(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    cache = HashCache(tmp_path / "hashes.json")
    first = checkpoint_hash(ckpt, cache)
    assert (cache.hits, cache.misses) == (0, 3)
    assert checkpoint_hash(ckpt, cache) == first and (cache.hits, cache.misses) == (3, 3)
    # same size, new content and mtime: rehashed, and the hash changes
    shard = ckpt / "model-00002.safetensors"
    shard.write_bytes(b"c" * 1000)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    second = checkpoint_hash(ckpt, cache)
    assert second != first and cache.misses == 4
    # the hash covers every weight file and the config
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_text", "x": 1}')
    assert checkpoint_hash(ckpt, cache) not in (first, second)


def test_cache_survives_corruption(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    cache_file = tmp_path / "hashes.json"
    cache_file.write_text("{not json")
    assert len(checkpoint_hash(ckpt, HashCache(cache_file))) == 64
    assert json.loads(cache_file.read_text())   # rewritten cleanly


def test_checkpoint_without_config_or_weights(tmp_path):
    with pytest.raises(CalibrationError, match="no config.json"):
        checkpoint_hash(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CalibrationError, match="no \\*.safetensors"):
        checkpoint_hash(tmp_path)


def test_corpus_hash_depends_on_text_and_order():
    a = corpus_hash([("a.txt", "hello"), ("b.txt", "world")])
    assert a == corpus_hash([("a.txt", "hello"), ("b.txt", "world")])
    assert a != corpus_hash([("b.txt", "world"), ("a.txt", "hello")])
    assert a != corpus_hash([("a.txt", "hello!"), ("b.txt", "world")])
