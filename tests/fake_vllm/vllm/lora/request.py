"""vLLM's LoRA request, which lm-eval's VLLM model imports; the stand-in serves no adapters."""


class LoRARequest:
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = ""):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
