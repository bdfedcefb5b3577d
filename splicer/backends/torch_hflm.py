"""lm-evaluation-harness's HF model over the torch backend's model, its log-likelihood forward computed as the backend's
scoring passes are (TorchBackend._scoring_products). Imported where lm-eval runs (TorchBackend.lm_eval_model), never at
splicer's import: lm-eval is an extra."""

from __future__ import annotations

from lm_eval.models.huggingface import HFLM


class ScoringProductsHFLM(HFLM):
    """lm-eval's HFLM whose _model_call (the forward of loglikelihood and loglikelihood_rolling: a batch of whole
    requests at once) runs inside products(model), the torch backend's _scoring_products: on the CPU with a BF16 model,
    its BF16 matrix products as FP32 products of the same values, rounded to BF16; elsewhere nothing changes.
    Generation (generate_until, through _model_generate) keeps torch's own products: one row at a time, converting
    every weight per token would cost more than it saves."""

    def __init__(self, *args, products, **kwargs):
        self._products = products  # set first: HFLM's __init__ may already call _model_call (batch_size="auto")
        super().__init__(*args, **kwargs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with self._products(self.model):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
