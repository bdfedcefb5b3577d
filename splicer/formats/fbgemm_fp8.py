"""FBGEMM FP8 (`quant_method: fbgemm_fp8`, Meta's Llama 3.1 405B FP8): e4m3 weights with one float32 scale per output
channel, activations scaled per token under `activation_scale_ub`; `modules_to_not_convert` lists what stays BF16.

Readers: vLLM 0.26 `layers/quantization/fbgemm_fp8.py` (`FBGEMMFp8Config`: both keys required; only `LinearBase`
layers are quantized, a skipped one matched by its exact name as native FP8's loader does, MoE layers always BF16) and
transformers 5 `quantizers/quantizer_fbgemm_fp8.py` (`replace_with_fbgemm_fp8_linear`: nn.Linear only, the head
skipped by default when the list is absent)."""

from __future__ import annotations

from ..errors import SplicerError
from .skip_list import SkipListFormat


class FbgemmFp8(SkipListFormat):
    quant_method = "fbgemm_fp8"
    read_as = "FBGEMM FP8"
    hf_cannot_load_experts = (
        "transformers 5 replaces only nn.Linear modules with FBGEMM FP8 ones, so it cannot load routed experts stored "
        "as FP8 (nor can vLLM: its FBGEMM loader quantizes no MoE layer)"
    )
    vllm_quantizes_moe = False

    def checkpoint_format(self, qc):
        return "per-channel"

    def scheme(self, qc):
        return "fp8 channel"

    def module_scheme(self, qc, module):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        return QuantizationScheme(targets=["Linear"], weights=args, format="float-quantized")

    def validate_config(self, build, qc):
        """What vLLM's FBGEMMFp8Config.from_config requires (both keys present), checked before anything is written."""
        ub = qc.get("activation_scale_ub")
        if isinstance(ub, bool) or not isinstance(ub, (int, float)) or ub <= 0:
            raise SplicerError(
                f"build {build.label}: an fbgemm_fp8 config needs a positive activation_scale_ub (vLLM requires it), "
                f"not {ub!r}; fix config.json"
            )
        if "modules_to_not_convert" not in qc:
            raise SplicerError(
                f"build {build.label}: the fbgemm_fp8 config has no modules_to_not_convert (vLLM requires it, [] for "
                "none); fix config.json"
            )
        self.validate_entries(build, qc)
        if not any(t.endswith(".weight_scale") for t in build.weight_map):
            raise SplicerError(
                f"build {build.label}: config.json says fbgemm_fp8 but no module has a weight_scale; "
                "the shards do not belong to this config"
            )


FORMAT = FbgemmFp8()
