"""A HF folder's safetensors files: which they are, and whether each can be opened. Free of
torch, so the CLI checks a folder before any process starts."""

from __future__ import annotations

import json
from pathlib import Path


def safetensors_shards(folder: Path, weight_map: dict[str, str] | None = None) -> list[str]:
    """The folder's safetensors files, as its index names them (else every one there);
    ValueError naming what is missing or broken. `weight_map`: the index, where the caller
    has read it already."""
    weight_map = weight_map or safetensors_weight_map(folder)
    if weight_map is not None:
        shard_names = sorted(set(weight_map.values()))
    else:
        shard_names = sorted(file.name for file in folder.glob("*.safetensors"))
    if not shard_names:
        raise ValueError(f"no .safetensors files in {str(folder)!r} (other weight formats are not read)")
    return shard_names


def safetensors_weight_map(folder: Path) -> dict[str, str] | None:
    """The shard each weight is in, as model.safetensors.index.json says (None without one);
    ValueError for an index that is not one, or names a shard outside the folder."""
    index_path = folder / "model.safetensors.index.json"
    if not index_path.is_file():
        return None
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not all(isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index_path.name} has no readable weight_map") from None
    for shard in weight_map.values():
        if shard != Path(shard).name or shard in ("", ".", ".."):
            raise ValueError(f"{index_path.name} names the shard {shard!r}, which is not a file of the model's folder")
    return weight_map


def check_safetensors(folder: Path) -> None:
    """Open every shard's header (cheap: the tensors stay on disk): ValueError naming a shard
    that is missing, not safetensors, or cut short."""
    from safetensors import safe_open

    for shard_name in safetensors_shards(folder):
        if not (folder / shard_name).is_file():
            raise ValueError(f"{shard_name}, named in model.safetensors.index.json, is missing")
        try:
            with safe_open(str(folder / shard_name), framework="numpy"):
                pass
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError (an Exception)
            raise ValueError(f"{shard_name} cannot be read as safetensors: {e}") from None
