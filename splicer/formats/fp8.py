"""Native FP8 (`quant_method: fp8`, DeepSeek-V3, Qwen *-FP8): e4m3 weights with 128x128 block scales
(`weight_block_size`) or one per tensor; `ignored_layers` / `modules_to_not_convert` list what stays BF16."""

from __future__ import annotations

import json

from ..errors import SplicerError
from .skip_list import SkipListFormat


class NativeFp8(SkipListFormat):
    quant_method = "fp8"
    read_as = "native FP8"

    def checkpoint_format(self, qc):
        block = qc.get("weight_block_size")
        return f"block{block[0]}x{block[1]}" if block else "per-tensor"

    def config_block(self, qc):
        b = qc.get("weight_block_size")
        return (int(b[0]), int(b[1])) if isinstance(b, list) and len(b) == 2 else None

    def skip_lists(self, qc):
        """vLLM 0.26 `Fp8Config.from_config` reads `ignored_layers` and only when that is missing or empty
        `modules_to_not_convert`; transformers' FineGrainedFP8Config reads `modules_to_not_convert` and takes
        `ignored_layers` only as an alias when the former is absent."""
        vllm = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        hf = qc.get("modules_to_not_convert")
        return (qc.get("ignored_layers") if hf is None else hf), list(vllm)

    def skip_list_keys(self, qc):
        """The list each reader reads (see skip_lists), else modules_to_not_convert (read by transformers, and by vLLM's
        FP8 loader when ignored_layers is missing or empty). An empty ignored_layers beside a full
        modules_to_not_convert is not one of them: filling it would hide the other list from vLLM."""
        vllm_key = (
            "ignored_layers"
            if qc.get("ignored_layers")
            else "modules_to_not_convert"
            if qc.get("modules_to_not_convert")
            else None
        )
        hf_key = (
            "modules_to_not_convert"
            if qc.get("modules_to_not_convert") is not None
            else "ignored_layers"
            if qc.get("ignored_layers") is not None
            else None
        )
        keys = [k for k in ("ignored_layers", "modules_to_not_convert") if k in (vllm_key, hf_key)]
        return keys or ["modules_to_not_convert"]

    def scheme(self, qc):
        block = qc.get("weight_block_size")
        return f"fp8 block{block[0]}x{block[1]}" if block else "fp8 tensor"

    def module_scheme(self, qc, module):
        from .quantize import native_fp8_scheme

        return native_fp8_scheme(qc.get("weight_block_size"))

    def add_list_issues(self, qc, report):
        hf_list, vllm_list = self.skip_lists(qc)
        if hf_list is not None and list(hf_list) != vllm_list:
            report.add(
                "skip-lists-differ",
                "hf+vllm",
                "ignored_layers and modules_to_not_convert differ: vLLM reads "
                "ignored_layers, transformers modules_to_not_convert; keep one list",
            )

    def add_notes(self, qc, report):
        if not qc.get("weight_block_size"):
            report.notes.append(
                "transformers' FineGrainedFP8 loader assumes 128x128 blocks (weight_scale_inv): it cannot load "
                "this per-tensor FP8 build; vLLM can"
            )

    def validate_config(self, build, qc):
        """What vLLM's Fp8Config.from_config requires of a native FP8 config, checked before anything is written."""
        scheme = qc.get("activation_scheme")
        if scheme not in ("static", "dynamic"):
            raise SplicerError(
                f"build {build.label}: a native FP8 config needs activation_scheme 'static' or 'dynamic', "
                f"not {scheme!r}; fix config.json"
            )
        block = qc.get("weight_block_size")
        if block is not None and (
            not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise SplicerError(
                f"build {build.label}: weight_block_size {json.dumps(block)} is not two positive integers; fix config.json"
            )
        if block is not None and scheme != "dynamic":
            raise SplicerError(
                f"build {build.label}: block FP8 needs activation_scheme 'dynamic' (vLLM refuses {scheme!r}); fix config.json"
            )
        self.validate_entries(build, qc)
        if not any(t.endswith((".weight_scale_inv", ".weight_scale")) for t in build.weight_map):
            raise SplicerError(
                f"build {build.label}: config.json says fp8 but no module has a weight_scale_inv or weight_scale; "
                "the shards do not belong to this config"
            )


FORMAT = NativeFp8()
