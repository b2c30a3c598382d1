"""Where each tensor of a checkpoint lives, and reading just the tensors one layer needs.

Only safetensors headers are read up front, so checking names and shapes for every layer
costs no weight I/O; a layer's tensors are read when that layer runs.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from ..calibration_settings import CalibrationError


INDEX_NAME = "model.safetensors.index.json"


def read_weight_map(root: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's weight_map (tensor name -> shard file name), or None when the
    checkpoint has no index."""
    path = root / INDEX_NAME
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path} is not readable JSON: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CalibrationError(f"{path} has no weight_map object of tensor name -> shard file name")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard or not (root / shard).is_file():
            raise CalibrationError(f"{path} names shard {shard!r}, which is not a file in {root}")
    return weight_map


class WeightIndex:
    """Every tensor's shard. With model.safetensors.index.json the index decides: its shards are
    read, each tensor must be in the shard it names, and other *.safetensors files are not read.
    Without one, every *.safetensors file is read and a tensor name in two of them is an error
    (which one holds the model's tensor is not knowable)."""

    def __init__(self, checkpoint: str | Path):
        self.root = Path(checkpoint)
        weight_map = read_weight_map(self.root)
        if weight_map is None:
            self.files = sorted(self.root.glob("*.safetensors"))
        else:
            self.files = sorted(self.root / shard for shard in set(weight_map.values()))
        if not self.files:
            raise CalibrationError(f"no *.safetensors weight files in checkpoint folder {self.root}")
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():
                        if weight_map is not None and weight_map.get(name) != f.name:
                            continue    # the index places this name in another shard, or nowhere
                        if name in self.location:
                            raise CalibrationError(f"tensor {name!r} is in two weight files, {self.location[name]} "
                                                   f"and {f}: remove one, or add {INDEX_NAME} to say which")
                        self.location[name] = f
                        self.shapes[name] = tuple(fh.get_slice(name).get_shape())
            except CalibrationError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise CalibrationError(f"cannot read weight file {f}: {exc}") from exc
        if weight_map is not None:
            missing = sorted(n for n in weight_map if n not in self.location)
            if missing:
                raise CalibrationError(f"{self.root / INDEX_NAME} places {len(missing)} tensor(s) in shards that do "
                                       f"not hold them, e.g. {missing[0]!r} in {weight_map[missing[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(n for n in self.location if n.startswith(prefix))

    def find_suffix(self, suffix: str) -> str | None:
        """The shortest tensor name ending in suffix (e.g. 'embed_tokens.weight'), or None."""
        hits = [n for n in self.location if n.endswith(suffix)]
        return min(hits, key=len) if hits else None

    def require(self, name: str, what: str, shape: tuple[int, ...] | None = None) -> None:
        if name not in self.location:
            raise CalibrationError(f"checkpoint {self.root} has no tensor {name!r} ({what})")
        if shape is not None and self.shapes[name] != tuple(shape):
            raise CalibrationError(f"tensor {name!r} ({what}) has shape {self.shapes[name]}, expected {tuple(shape)}")

    def load(self, names: list[str], device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            if n not in self.location:
                raise CalibrationError(f"checkpoint {self.root} has no tensor {n!r}")
            by_file[self.location[n]].append(n)
        out = {}
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for n in group:
                    t = fh.get_tensor(n)
                    out[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return out

    def load_prefix(self, prefix: str, device="cpu", dtype=None) -> dict[str, torch.Tensor]:
        """Every tensor under prefix, keyed by the name with the prefix removed."""
        tensors = self.load(self.names_with_prefix(prefix), device, dtype)
        return {n[len(prefix):]: t for n, t in tensors.items()}
