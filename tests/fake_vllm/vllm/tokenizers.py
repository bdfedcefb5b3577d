"""vLLM's get_tokenizer (vllm.tokenizers since vLLM 0.12), which lm-eval's VLLM model imports: transformers' tokenizer."""


def get_tokenizer(tokenizer_name, *args, tokenizer_mode="auto", trust_remote_code=False, revision=None, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_name), trust_remote_code=trust_remote_code, revision=revision, **kwargs)
