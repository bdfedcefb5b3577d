"""AWQ as AutoAWQ's GEMM kernel stores it (`quant_method: awq`, `version: gemm`): 4-bit with zero points;
`modules_to_not_convert` lists what stays BF16. The packing itself is in splicer/formats/awq_tensors.py."""

from __future__ import annotations

from ..errors import SplicerError
from .skip_list import SkipListFormat


class Awq(SkipListFormat):
    quant_method = "awq"
    read_as = "AWQ (gemm)"
    hf_default_skips_always = True  # replace_with_awq_linear(add_default_skips=True)
    hf_cannot_load_experts = (
        "transformers 5 replaces only nn.Linear modules with AWQ ones (integrations/awq.py), so it cannot load "
        "routed experts stored as AWQ (vLLM can)"
    )
    vllm_matches_substring = True
    vllm_detects_empty_list = True

    def vllm_reads_head_quantized(self, qc):
        return bool(qc.get("lm_head"))

    def unreadable(self, qc):
        version = str(qc.get("version", "gemm")).lower()
        return None if version == "gemm" else f"AWQ version {qc.get('version')!r} (splicer reads gemm)"

    def scheme(self, qc):
        return f"int{qc.get('w_bit', qc.get('bits'))} g{qc.get('q_group_size', qc.get('group_size'))}"

    def module_scheme(self, qc, module):
        return module.group_size

    def add_notes(self, qc, report):
        if "bits" not in qc or "group_size" not in qc:
            report.notes.append(
                "transformers' AwqConfig reads bits and group_size only (defaults 4 and 128), not w_bit / "
                "q_group_size, which vLLM also reads; write both spellings for transformers"
            )

    def validate_config(self, build, qc):
        """What vLLM's AutoAWQConfig reads (w_bit|bits, q_group_size|group_size, zero_point), for AutoAWQ's GEMM layout."""
        bits, group = qc.get("w_bit", qc.get("bits")), qc.get("q_group_size", qc.get("group_size"))
        if bits != 4:
            raise SplicerError(f"build {build.label}: AWQ bits {bits!r}; vLLM and AutoAWQ's GEMM layout take 4-bit only")
        if not isinstance(group, int) or group <= 0:
            raise SplicerError(f"build {build.label}: AWQ group_size {group!r} is not a positive integer; fix config.json")
        if "zero_point" not in qc:
            raise SplicerError(f"build {build.label}: the AWQ config has no zero_point (vLLM requires it); fix config.json")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise SplicerError(
                f"build {build.label}: AWQ version {qc.get('version')!r}; splicer reads AutoAWQ's gemm layout only"
            )
        self.validate_entries(build, qc)
        if not any(t.endswith(".qweight") for t in build.weight_map):
            raise SplicerError(
                f"build {build.label}: config.json says awq but no tensor is packed (no qweight); the shards do not belong to this config"
            )


FORMAT = Awq()
