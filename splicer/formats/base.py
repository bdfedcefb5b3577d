"""The interface every quantization format implements: one class per quantization_config dialect.

A format answers, for configs of its quant_method: is the config one splicer can read and what the tensors say
(validate), how each reader (the field library with HF names, vLLM with its own) reads it per module (check), the
config edit that makes restored modules read as unquantized (exclusions), and what the torch reference dequantizes
each module with (torch_schemes). The shared reader machinery (Reading, Report, the storage checks) is readings.py.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Protocol

from ..arch.table import Architecture
from ..errors import SplicerError
from .module import Module
from .readings import Report


class Checkpoint(Protocol):
    """What a format reads of an opened checkpoint (checkpoint.Checkpoint, which the formats sit below: opening one
    checks its config with the format's config_fields)."""

    label: str
    weight_map: dict[str, str]

    @property
    def arch(self) -> Architecture: ...


class QuantFormat(ABC):
    quant_method: str  # config.json quantization_config.quant_method
    read_as: str  # what splicer reads of it, as messages list it ("AWQ (gemm)")
    # inspect also reports what validate_config refuses (the loader's own requirements of the config itself)
    inspect_validates_config = False
    # the JSON types and ranges of the quantization_config fields its readers read (config_schema.Field), checked when
    # a checkpoint is opened
    config_fields: tuple = ()

    # ------------------------------------------------------------ the config
    def unreadable(self, qc: dict) -> str | None:
        """Why splicer cannot read this config's quantized modules (None: it can)."""
        return None

    def checkpoint_format(self, qc: dict) -> str | None:
        """The storage format the config names, in a word."""
        return qc.get("format") or qc.get("checkpoint_format") or qc.get("version")

    def config_block(self, qc: dict) -> tuple[int, int] | None:
        """The one FP8 block size the config states: the block_structure every block group shares (None: none or
        several)."""
        blocks = {
            tuple((g.get("weights") or {}).get("block_structure") or ())
            for g in (qc.get("config_groups") or {}).values()
            if isinstance(g, dict) and (g.get("weights") or {}).get("strategy") == "block"
        }
        blocks.discard(())
        return next(iter(blocks)) if len(blocks) == 1 else None

    def check_config_fields(self, qc: dict, where: str) -> None:
        """Rules across the config_fields (each checked alone already), refused in one line when a checkpoint is opened."""
        return None  # none for a format whose fields stand alone

    def validate_regexes(self, qc: dict, label: str) -> None:
        """Every regex the readers will compile: `re:` ignore entries and targets."""
        for entry in list(qc.get("ignore") or []) + [
            t for g in (qc.get("config_groups") or {}).values() for t in g.get("targets", [])
        ]:
            if not isinstance(entry, str):
                raise SplicerError(
                    f"{label}: quantization_config has a non-string ignore/target entry {entry!r}; fix config.json"
                )
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as e:
                    raise SplicerError(
                        f"{label}: quantization_config entry {entry!r} is not a valid regex ({e}); fix config.json"
                    ) from None

    @abstractmethod
    def validate_config(self, build: Checkpoint, qc: dict) -> None:
        """Refuse, in one line, a build config the loaders would refuse or misread, or shards that do not belong to it."""

    @abstractmethod
    def validate_schemes(self, build: Checkpoint, qc: dict, modules: dict[str, Module]) -> None:
        """Refuse a build whose quantized modules are stored otherwise than the config says."""

    # ------------------------------------------------------------ the readers
    @abstractmethod
    def check(
        self,
        modules: dict[str, Module],
        qc: dict,
        arch: Architecture,
        report: Report,
        tensor_dtypes: dict[str, str] | None = None,
    ) -> Report:
        """Fill report with each reader's reading of every module and what the config gets wrong."""

    # ------------------------------------------------------------ the config edit
    @abstractmethod
    def exclude_restored(self, qc: dict, modules: dict[str, Module], picked: dict[str, Module], arch: Architecture) -> None:
        """Edit qc so that both readers read the picked (restored) modules as unquantized."""

    def exclude_added(self, qc: dict, added: dict[str, Module], arch: Architecture) -> None:
        """Edit qc so that an added BF16 MTP head is not read as quantized."""
        self.add_exclusions(qc, [arch.mtp_ignore])

    @abstractmethod
    def add_exclusions(self, qc: dict, entries: list[str]) -> None:
        """Add entries to the config's list of what stays unquantized."""

    @abstractmethod
    def remove_exclusions(self, qc: dict, entries: set[str]) -> None:
        """Remove entries from the config's list of what stays unquantized."""

    @abstractmethod
    def exclusions(self, qc: dict) -> list[str]:
        """The entries that keep modules unquantized."""

    def drop_unused(self, config: dict, report: Report, after: dict[str, Module]) -> None:
        """After the edit: drop the quantization_config when no module is quantized any more."""
        if not any(m.quantized for m in after.values()):
            del config["quantization_config"]

    # ------------------------------------------------------------ the torch reference
    @abstractmethod
    def torch_schemes(self, ckpt: Checkpoint, qc: dict, modules: dict[str, Module]) -> dict:
        """Quantized module -> (its Module, what the torch reference dequantizes it with); refuses, in one line, a
        module the config and the tensors disagree on."""
