"""The quantization formats splicer reads: one module per quantization_config dialect, one lookup by quant_method.

Each dialect (compressed_tensors, gptq, awq, fp8) implements `base.QuantFormat`: what its config must hold, how
compressed-tensors / GPTQModel / transformers and vLLM read it per module, the config edit that leaves restored modules
unquantized, and how the torch reference dequantizes its modules. `registry` looks a config's format up. Below the
dialects: `layouts`, the table of how each stores a quantized module's tensors; `readings`, what their readers share;
`module_regexes`, the regexes their config edits name modules with; `module`, the record of one module. The tensor
arithmetic the torch reference dequantizes with and the fixtures quantize with: `quantize` (compressed-tensors),
`gptq_tensors` (GPTQ v1), `awq_tensors` (AWQ GEMM). docs/formats.md says how to add one.

It imports nothing: the modules the dialects build on read the layout table, and reading it must not load them.
"""
