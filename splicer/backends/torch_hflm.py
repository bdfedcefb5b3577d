"""lm-evaluation-harness's HF model over the torch backend's model, its log-likelihood forward computed as the backend's
scoring passes are (TorchBackend._scoring_products). Imported where lm-eval runs (TorchBackend.lm_eval_model), never at
splicer's import: lm-eval is an extra."""

from __future__ import annotations

from lm_eval.models.huggingface import HFLM


class ScoringProductsHFLM(HFLM):
    """lm-eval's HFLM whose _model_call (the forward of loglikelihood and loglikelihood_rolling: a batch of whole
    requests at once) runs inside products(model), the torch backend's _scoring_products: on the CPU with a BF16 model,
    its BF16 matrix products and convolutions as FP32 ones of the same values, rounded to BF16; elsewhere nothing
    changes. Generation (generate_until, through _model_generate) runs inside generation_products(model), the backend's
    _generation_products, as the backend's own generate(): the convolutions only, since one row at a time converting
    every GEMM weight per token would cost more than it saves."""

    def __init__(self, *args, products, generation_products, **kwargs):
        # set first: HFLM's __init__ may already call _model_call (batch_size="auto")
        self._products, self._generation_products = products, generation_products
        super().__init__(*args, **kwargs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with self._products(self.model):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, *args, **kwargs):
        with self._generation_products(self.model):
            return super()._model_generate(*args, **kwargs)
