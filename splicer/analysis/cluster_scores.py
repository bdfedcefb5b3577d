"""Per-cluster scores: a results folder's per-position scores collapsed onto the units its intervals resample.

Every interval splicer reports (paired differences, the engine's run-to-run noise, the budget's predictions) is a
function of sums over clusters (a sequence, or a group of conversations that share a prompt): per cluster, the
weighted sums of KL, top-1 and (on answer positions) dNLL, and the weight itself. So one record per cluster and part
(answer positions apart from the rest) carries everything the intervals need, at a few hundred bytes per row and corpus
where the per-position files take megabytes: DIR/cluster-scores.safetensors. A folder shared or committed without its
DIR/scores/ keeps every interval recomputable (`splicer compare`, `splicer budget`), to float rounding.

`ablate` updates the file after every finished row (so do `budget --verify` and `score`, which run it): a finished row
with per-position files gets its records from them; a finished row whose files are gone keeps the records the file
already held; a row results.json does not list as finished has none. The file names the build and base it was scored
on (their digests in results.json), and a file from another folder is refused when read.

A collapsed record has the per-position record's keys (verdicts.load_scores returns either): each pseudo-position is
one (cluster, answer part) with the weighted mean of each quantity and the summed weight, so the sums over a cluster
are the per-position ones. `positions_sha256` (32 bytes) stands for the positions and tokens scored, so two rows are
still known to be scored on the same positions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..errors import SplicerError

FILE_NAME = "cluster-scores.safetensors"
FORMAT = "splicer cluster scores, version 1"
# Quantities averaged per pseudo-position (weighted); the rest of a per-position record is not needed by an interval.
MEANS = ("kl_top", "top1", "dlogp")
NEEDED = ("weight", "answer_mask", "positions_sha256", "seq_index", "kl_top", "top1")
SEP = "/"  # key = ROW/CORPUS/FIELD; a row's name never holds a slash (it names a folder under DIR/scores/)


def positions_digest(record: dict) -> torch.Tensor:
    """32 bytes that differ when two records cover other positions or tokens."""
    h = hashlib.sha256()
    for key in ("target", "seq_index", "group", "weight", "answer_mask"):
        if key in record:
            t = record[key].contiguous()
            h.update(key.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).clone()


def collapse(record: dict) -> dict:
    """One pseudo-position per (cluster, answer part) of a per-position score record, clusters in increasing order."""
    cluster_key = "group" if "group" in record else "seq_index"
    cluster = record[cluster_key].long()
    n = cluster.numel()
    w = record["weight"].double() if "weight" in record else torch.ones(n, dtype=torch.float64)
    answer = record["answer_mask"].bool() if "answer_mask" in record else torch.zeros(n, dtype=torch.bool)
    key = cluster * 2 + answer.long()  # answer positions of a cluster after the rest of it
    parts, inverse = torch.unique(key, return_inverse=True)
    weight = torch.zeros(parts.numel(), dtype=torch.float64).index_add_(0, inverse, w)
    out = {
        cluster_key: torch.div(parts, 2, rounding_mode="floor"),
        "weight": weight,
        "answer_mask": (parts % 2).bool(),
        "positions_sha256": positions_digest(record),
    }
    if cluster_key == "group":
        out["seq_index"] = out["group"].clone()  # budget checks its length; safetensors stores no shared tensors
    safe = torch.where(weight > 0, weight, torch.ones_like(weight))
    for q in MEANS:
        if q in record:
            sums = torch.zeros(parts.numel(), dtype=torch.float64).index_add_(0, inverse, record[q].double() * w)
            out[q] = torch.where(weight > 0, sums / safe, torch.zeros_like(sums))
    return out


def owner(results: dict) -> dict:
    """What a folder's cluster scores belong to: the digests of the build and base its rows were scored against."""
    inputs = results.get("inputs") or {}
    return {
        "build": (inputs.get("build") or {}).get("header_digest"),
        "base": (inputs.get("base") or {}).get("digest") or (inputs.get("base") or {}).get("header_digest"),
    }


def _read(path: Path) -> tuple[dict, dict]:
    """(records by 'ROW/CORPUS', owner) of a cluster-scores file, or a one-line error saying what is wrong with it."""
    from safetensors import safe_open

    fix = f"remake it with `splicer cluster-scores {path.parent}` from the folder's scores/, or delete it"
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a damaged or foreign file
        raise SplicerError(f"{path} cannot be read as cluster scores ({str(e).splitlines()[0][:120]}); {fix}") from None
    try:
        info = json.loads(meta.get("splicer", "null"))
    except json.JSONDecodeError:
        info = None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SplicerError(f"{path} is not a splicer cluster-scores file ({FORMAT!r} is not in its metadata); {fix}")
    records: dict = {}
    for key, t in tensors.items():
        head, _, field = key.rpartition(SEP)
        if SEP not in head:
            raise SplicerError(f"{path} holds a tensor {key!r} that is no ROW/CORPUS/FIELD; {fix}")
        records.setdefault(head, {})[field] = t
    for head, rec in records.items():
        missing = [k for k in NEEDED if k not in rec]
        if missing:
            raise SplicerError(f"{path}: the record {head} lacks {', '.join(missing)}; {fix}")
    return records, info.get("owner") or {}


def _per_position(folder: Path, row: str) -> dict[str, dict]:
    """corpus -> collapsed record of a row's per-position files in DIR/scores/ROW/ (empty when there are none)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted((folder / "scores" / row).glob("*.safetensors")):
        try:
            out[f.stem] = collapse(load_file(str(f)))
        except Exception as e:  # a truncated or foreign file: safetensors' own error, or a missing key
            raise SplicerError(
                f"{f} cannot be read as a row's scores ({str(e).splitlines()[0][:120]}); the per-position scores of "
                f"{folder} are damaged: restore the file from a copy, or run that row again into a new folder"
            ) from None
    return out


def update(folder: Path, results: dict) -> tuple[Path, dict[str, str]] | None:
    """Rewrite DIR/cluster-scores.safetensors for the rows results.json lists as finished: from their per-position
    files where DIR/scores/ROW/ holds them, else as the file already held them. Returns (file, row -> 'scores' or
    'kept'), or None when there is nothing to write (no finished row has scores anywhere)."""
    from ..io.outputs import write_file

    folder = Path(folder)
    path = folder / FILE_NAME
    finished = [v["name"] for v in results.get("variants", []) if v.get("status") == "ok" and isinstance(v.get("name"), str)]
    old: dict = {}
    if path.exists():
        records, old_owner = _read(path)
        if old_owner == owner(results):  # a file of another folder's inputs gives nothing
            old = records
    tensors, source = {}, {}
    for row in finished:
        fresh = _per_position(folder, row)
        if fresh:
            records = {f"{row}{SEP}{corpus}": rec for corpus, rec in fresh.items()}
            source[row] = "scores"
        else:
            records = {head: rec for head, rec in old.items() if head.split(SEP, 1)[0] == row}
            if records:
                source[row] = "kept"
        for head, rec in records.items():
            for field, t in rec.items():
                tensors[f"{head}{SEP}{field}"] = t.contiguous()
    if not tensors:
        return None
    # One metadata key: safetensors writes several in any order, and the same scores should give the same bytes.
    meta = {"splicer": json.dumps({"format": FORMAT, "owner": owner(results)}, sort_keys=True)}

    def save(tmp):
        from safetensors.torch import save_file

        save_file(tensors, str(tmp), metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # readable as results.json is: the file exists to be shared

    return write_file(path, save), source


def write(folder: Path) -> tuple[Path, dict[str, str]]:
    """`splicer cluster-scores DIR`: update() from the folder's own results.json, or a one-line error."""
    from ..io import results_record

    folder = Path(folder)
    if not folder.is_dir():
        raise SplicerError(f"{folder} is not a folder; pass a results folder splicer ablate or score wrote")
    done = update(folder, results_record.read(folder))
    if done is None:
        raise SplicerError(
            f"{folder} has no scores of a finished row: neither scores/ROW/ nor a {FILE_NAME}; "
            f"run splicer ablate with -o {folder} first"
        )
    return done


class ClusterScores:
    """DIR/cluster-scores.safetensors, read once per change: the collapsed record of a row and corpus, or None."""

    _open: dict = {}

    @classmethod
    def get(cls, folder: Path, row: str, corpus: str) -> dict | None:
        folder = Path(folder)
        path = folder / FILE_NAME
        if not path.exists():
            return None
        stamp = (str(path.resolve()), path.stat().st_mtime_ns, path.stat().st_size)
        if stamp not in cls._open:
            records, file_owner = _read(path)
            from ..io import results_record

            here = owner(results_record.read(folder))
            if file_owner != here:
                raise SplicerError(
                    f"{path} holds the scores of another build or base than {folder}/results.json names; "
                    f"delete it, or remake it with `splicer cluster-scores {folder}` from the folder's scores/"
                )
            cls._open = {stamp: records}  # one folder at a time: a results folder is read whole, then left
        return cls._open[stamp].get(f"{row}{SEP}{corpus}")
