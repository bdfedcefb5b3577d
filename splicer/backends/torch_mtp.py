"""The MTP drafters the torch backend runs, one definition each, shared with the trained model (trained/train.py):
a family's architecture table names its drafter (Architecture.mtp_drafter), and a family whose drafter is not
modeled here is refused in one line.

qwen3_5_mtp is vLLM's drafter of Qwen3.5 / Qwen3.6 (model_executor/models/qwen3_5_mtp.py): the next token's embedding
and the trunk's last hidden state (after its final norm), each RMS-normed, concatenated [embedding, hidden],
projected by `fc`, one full-attention decoder layer of the family, a final norm, and the trunk's own lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SplicerError


class MTPHead(nn.Module):
    """vLLM's qwen3_5_mtp drafter: fc([norm(embed(x_{t+1})), norm(h_t)]) -> one full-attention layer -> norm."""

    def __init__(self, tc):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

        h = tc.hidden_size
        full = tc.layer_types.index("full_attention")
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(tc, full)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)

    def forward(self, next_embeds, hidden, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


DRAFTERS = {"qwen3_5_mtp": MTPHead}  # Architecture.mtp_drafter -> the module that runs it


def drafter_class(arch) -> type[nn.Module]:
    """The drafter module of a family, or a one-line refusal naming the family (and its MTP layout, where it has one)."""
    if arch.mtp_drafter in DRAFTERS:
        return DRAFTERS[arch.mtp_drafter]
    if arch.mtp_prefix is None and not arch.mtp_layer_key:
        raise SplicerError(f"{arch.name} has no MTP head: there is no drafter to run; teacher-forced acceptance needs one")
    layout = f" ({arch.mtp_layout})" if arch.mtp_layout else ""
    raise SplicerError(
        f"the torch backend does not model {arch.name}'s MTP drafter{layout}, only "
        f"{', '.join(DRAFTERS)}: measure its acceptance in vLLM with splicer mtp DIR on a --backend vllm folder"
    )


def draft_logits(drafter: nn.Module, text_model, lm_head: nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor):
    """The drafter's logits for the pairs (h_t, x_{t+1}), t = 0 .. n-1: hidden [B, n, H] (the trunk's last hidden state,
    after its final norm), next_ids [B, n] (x_{t+1}) -> [B, n, V], its guess at x_{t+2}. Positions 0 .. n-1 (the rotary
    embedding is relative, so an offset changes nothing but rounding); the embedding, rotary embedding and head are
    the trunk's own (text_model: transformers' text model of the family)."""
    nxt = text_model.embed_tokens(next_ids)
    b, n = next_ids.shape
    positions = torch.arange(n, device=next_ids.device).view(1, 1, -1).expand(3, b, -1)  # one row per mrope section
    return lm_head(drafter(nxt, hidden, text_model.rotary_emb(nxt, positions)))
