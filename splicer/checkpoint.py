"""Reading a checkpoint: a local folder or a Hub repo id, its config, index and shard headers.

Only JSON and safetensors headers are parsed here; tensor data is read later, one tensor
at a time, by the stage that needs it. Pickle files are never opened.

A stage of its own, right above formats/: opening a checkpoint checks its config's quantization fields through the
format registry, so that no stage holds a checkpoint whose fields went unchecked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .arch import get_architecture
from .arch.table import Architecture
from .errors import SplicerError
from .formats.registry import format_of
from .io.config_schema import QC, check_common_fields, check_fields
from .io.safetensors_io import ShardHeader, TensorInfo, headers_digest, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Checkpoint:
    root: Path
    label: str  # what the user passed (folder or repo id), for messages
    config: dict
    weight_map: dict[str, str]  # tensor -> shard file name
    index_metadata: dict
    headers: dict[str, ShardHeader] = field(default_factory=dict)  # shard file name -> header

    @cached_property
    def arch(self) -> Architecture:  # looked up per tensor by inspect: resolve the model type once
        return get_architecture(self.config)

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    def tensor(self, name: str) -> TensorInfo:
        return self.headers[self.weight_map[name]].tensors[name]

    def header_digest(self) -> str:
        return headers_digest(self.headers.values())

    def other_files(self) -> list[Path]:
        """Every top-level file that is not a weight shard or the index: tokenizer, templates, configs.

        Top level only: that is all vLLM and transformers read, and whatever else sits in subfolders (someone's
        results, caches) must not travel into every output. Hidden files are skipped for the same reason.
        """
        shard_names = set(self.weight_map.values())
        return [
            p
            for p in sorted(self.root.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name not in shard_names and p.name != INDEX_NAME
        ]


def _load_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SplicerError(f"{path} is missing; {what} needs it") from None
    except IsADirectoryError:
        raise SplicerError(f"{path} is a folder, not a JSON file; restore it from the original checkpoint") from None
    except OSError as e:
        raise SplicerError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SplicerError(
            f"{path} is not valid JSON ({e.__class__.__name__}); restore it from the original checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise SplicerError(f"{path} is not a JSON object; restore it from the original checkpoint")
    return data


def resolve(source: str, role: str, wanted_files=None) -> Path:
    """A local folder as is; a Hub repo id through huggingface_hub's cache.

    `wanted_files(index_dict) -> set[str]` limits which shards are downloaded (the base
    needs only the shards holding the tensors to restore).
    """
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SplicerError(f"{role} {source} is a file, not a checkpoint folder; pass the folder that holds config.json")
        return path
    if not _REPO_ID.match(source) or source.startswith((".", "/")):
        raise SplicerError(f"{role} folder {source} does not exist; pass a checkpoint folder or a Hub repo id (owner/name)")
    return _resolve_hub(source, role, wanted_files)


def _resolve_hub(repo_id: str, role: str, wanted_files) -> Path:
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise SplicerError("huggingface_hub is not installed; pip install huggingface_hub") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    small = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md"]
    try:
        if wanted_files is None:
            return Path(snapshot_download(repo_id, allow_patterns=small + ["*.safetensors"]))
        index_path = Path(hf_hub_download(repo_id, INDEX_NAME))
        index = _load_json(index_path, f"{role} {repo_id}")
        shards = sorted(wanted_files(index))
        return Path(snapshot_download(repo_id, allow_patterns=small + shards))
    except (LocalEntryNotFoundError, FileNotFoundError):
        if offline:
            raise SplicerError(
                f"{role} {repo_id}: no such folder here, and as a Hub repo id it is not in the local cache while "
                "HF_HUB_OFFLINE is set; check the path, or download the repo first / unset HF_HUB_OFFLINE"
            ) from None
        raise SplicerError(
            f"{role} {repo_id}: no such folder here, and as a Hub repo id it could not be downloaded "
            "(no network?); check the path or pass a local folder"
        ) from None
    except RepositoryNotFoundError:
        raise SplicerError(
            f"{role} {repo_id} is not a Hub repository you can read; check the id or log in with `hf auth login`"
        ) from None
    except HfHubHTTPError as e:
        raise SplicerError(f"{role} {repo_id}: the Hub answered {e.__class__.__name__}; check the id and your network") from None
    except OSError as e:
        raise SplicerError(
            f"{role} {repo_id} could not be fetched ({e.__class__.__name__}); check your network or pass a local folder"
        ) from None


def check_config(config: dict, label: str) -> None:
    """Refuse a config.json whose fields have another JSON type or range than splicer and its readers expect: the
    fields every checkpoint's config has (config_schema), then those its quantization format's readers read."""
    check_common_fields(config, label)
    qc = config.get(QC)
    fmt = format_of(qc)
    if fmt is not None:  # other methods are refused by name where a build or a base is validated
        check_fields(config, fmt.config_fields, label)
        fmt.check_config_fields(qc, label)


def open_checkpoint(source: str | Path, role: str, wanted_files=None, shards: set[str] | None = None) -> Checkpoint:
    """Read config, index and the headers of `shards` (all shards when None)."""
    root = resolve(str(source), role, wanted_files)
    config = _load_json(root / "config.json", f"{role} {source}")
    check_config(config, f"{role} {source}")  # every field splicer reads has its JSON type and range
    if (root / INDEX_NAME).exists():
        index = _load_json(root / INDEX_NAME, f"{role} {source}")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SplicerError(f"{root / INDEX_NAME} has no weight_map; restore it from the original checkpoint")
        for tensor, shard in weight_map.items():
            check_shard_name(shard, root / INDEX_NAME, tensor)
        metadata = index.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise SplicerError(
                f"{root / INDEX_NAME}: metadata is a {type(metadata).__name__}, not an object; "
                "restore the index from the original checkpoint"
            )
    elif (root / SINGLE_NAME).exists():
        header = read_header(root / SINGLE_NAME)
        weight_map = {name: SINGLE_NAME for name in header.tensors}
        metadata = {}
    else:
        raise SplicerError(f"{role} {source} has neither {INDEX_NAME} nor {SINGLE_NAME}; is it a safetensors checkpoint?")
    ckpt = Checkpoint(root, str(source), config, dict(weight_map), metadata)
    ckpt.arch  # noqa: B018  fail early on an unsupported model_type
    for shard in sorted(set(weight_map.values()) if shards is None else shards):
        load_shard_header(ckpt, shard)
    return ckpt


def check_shard_name(shard, index_path: Path, tensor: str) -> None:
    """A shard named by the index must be a plain file name in the checkpoint folder: never a path that leads out of
    it (`../`, absolute), into a subfolder, or to something that is not safetensors; the name is later used to write
    the output's shard of the same name."""
    ok = (
        isinstance(shard, str)
        and shard.endswith(".safetensors")
        and shard == os.path.basename(shard)
        and "\\" not in shard
        and not shard.startswith(".")
        and shard.isprintable()
    )
    if not ok:
        raise SplicerError(
            f"{index_path} puts {tensor} in {shard!r}, which is not a .safetensors file name inside the "
            "checkpoint folder; restore the index from the original checkpoint"
        )


def load_shard_header(ckpt: Checkpoint, shard: str) -> ShardHeader:
    if shard in ckpt.headers:
        return ckpt.headers[shard]
    path = ckpt.root / shard
    if not path.exists():
        raise SplicerError(f"{ckpt.label}: the index names shard {shard}, which is missing; re-download the checkpoint")
    hdr = read_header(path)
    listed = {t for t, s in ckpt.weight_map.items() if s == shard}
    missing = sorted(listed - set(hdr.tensors))
    if missing:
        raise SplicerError(
            f"{ckpt.label}: the index puts {missing[0]} in {shard} but the shard does not hold it; "
            "the index and shards disagree, re-download the checkpoint"
        )
    # vLLM loads every tensor of every shard, whatever the index says: a tensor stored twice, or one the index does
    # not list, would be loaded (the last copy winning) while splice follows the index.
    extra = sorted(set(hdr.tensors) - listed)
    if extra:
        other = ckpt.weight_map.get(extra[0])
        where = f"the index puts it in {other}" if other else "the index does not list it"
        raise SplicerError(
            f"{ckpt.label}: shard {shard} holds {extra[0]} but {where}; the index and shards disagree, re-download the checkpoint"
        )
    ckpt.headers[shard] = hdr
    return hdr
