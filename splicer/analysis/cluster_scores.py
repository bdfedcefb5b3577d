"""Per-cluster scores: a results folder's per-position scores collapsed onto the units its intervals resample.

Every interval splicer reports (paired differences, the engine's run-to-run noise, the budget's predictions) is a
function of sums over clusters (a sequence, or a group of conversations that share a prompt): per cluster, the
weighted sums of KL, top-1 and (on answer positions) dNLL, and the weight itself. So one record per cluster and part
(answer positions apart from the rest) carries everything the intervals need, at a few hundred bytes per row and corpus
where the per-position files take megabytes: DIR/cluster-scores.safetensors. A folder shared or committed without its
DIR/scores/ keeps every interval recomputable (`splicer compare`, `splicer budget`), to float rounding.

A collapsed record has the per-position record's keys (verdicts.load_scores returns either): each pseudo-position is
one (cluster, answer part) with the weighted mean of each quantity and the summed weight, so the sums over a cluster
are the per-position ones. `positions_sha256` (32 bytes) stands for the positions and tokens scored, so two rows are
still known to be scored on the same positions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..errors import SplicerError

FILE_NAME = "cluster-scores.safetensors"
# Quantities averaged per pseudo-position (weighted); the rest of a per-position record is not needed by an interval.
MEANS = ("kl_top", "top1", "dlogp")
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


def write(folder: Path) -> tuple[Path, int, int]:
    """DIR/cluster-scores.safetensors from DIR/scores/ROW/CORPUS.safetensors of the rows results.json lists as
    finished (a row cut off mid-run may have left some of its files); returns (file, rows, records)."""
    from safetensors.torch import load_file

    from ..io import results_record
    from ..io.outputs import write_file

    folder = Path(folder)
    if not (folder / "scores").is_dir():
        raise SplicerError(f"{folder} has no scores/ folder of per-position scores; pass the results folder splicer ablate wrote")
    finished = {v.get("name") for v in results_record.read(folder)["variants"] if v.get("status") == "ok"}
    tensors = {}
    rows = 0
    for row_dir in sorted(p for p in (folder / "scores").iterdir() if p.is_dir() and p.name in finished):
        files = sorted(row_dir.glob("*.safetensors"))
        rows += bool(files)
        for f in files:
            for field, t in collapse(load_file(str(f))).items():
                tensors[SEP.join((row_dir.name, f.stem, field))] = t.contiguous()

    def save(tmp):
        from safetensors.torch import save_file

        # One metadata key: safetensors writes several in any order, and the file should be the same for the same scores.
        save_file(tensors, str(tmp), metadata={"format": "splicer cluster scores, version 1"})

    path = write_file(folder / FILE_NAME, save)
    return path, rows, len({k.rsplit(SEP, 1)[0] for k in tensors})


class ClusterScores:
    """DIR/cluster-scores.safetensors, read once: the collapsed record of a row and corpus, or None."""

    _open: dict = {}

    @classmethod
    def get(cls, folder: Path, row: str, corpus: str) -> dict | None:
        path = Path(folder) / FILE_NAME
        if not path.exists():
            return None
        stamp = (str(path.resolve()), path.stat().st_mtime_ns)
        if stamp not in cls._open:
            from safetensors.torch import load_file

            by_record: dict = {}
            for key, t in load_file(str(path)).items():
                head, field = key.rsplit(SEP, 1)
                by_record.setdefault(head, {})[field] = t
            cls._open = {stamp: by_record}  # one folder at a time: a results folder is read whole, then left
        return cls._open[stamp].get(SEP.join((row, corpus)))
