"""The MoE load-balancing (router auxiliary) loss of the whole batch under sequence parallelism.

transformers' ``load_balancing_loss_func`` (Switch Transformer eqs. 4-6; Mixtral, Qwen2/3-MoE, OLMoE, PhiMoE, ...)
pools over every layer and every token its attention mask keeps (``R`` = layers x tokens):
``f_e`` = top-k assignments to expert ``e`` / ``R``, ``P_e`` = router probability of ``e`` summed / ``R``, and
returns ``num_experts * sum_e f_e * P_e``. A shard alone gives a different value (transformers computes it per
shard under SP, per replica under DDP). Here each rank computes its shard's SUMS (:meth:`RouterAuxLoss.statistics`);
added over dp x sp in the loss's one all-reduce (:func:`ulysses_sp.causal_lm_loss`) they are the sums one process
computes over the full batch of all dp replicas, so :meth:`RouterAuxLoss.loss` is exact. The counts carry no
gradient (top-k picks); ``P``'s gradient flows back through the all-reduce and is right once averaged over
dp x sp, as the cross-entropy's (see :mod:`ulysses_sp.loss`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .hf import find_causal_lm, own_class, text_config

__all__ = ["RouterAuxLoss", "router_aux_loss"]

_STATE_ATTR = "_ulysses_router_aux"


@dataclass(frozen=True)
class RouterAuxLoss:
    """The load-balancing loss of a model: ``num_experts``, ``top_k`` and ``coef`` as its causal LM uses them."""

    num_experts: int
    top_k: int
    coef: float

    def statistics(
        self,
        router_logits: tuple[torch.Tensor, ...],
        token_mask: torch.Tensor | None,
        rows_kept: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This shard's sums ``[2E + 1]``: top-k assignments per expert (no gradient), router probabilities per
        expert, tokens; over every layer's router logits (``[tokens, E]``) and the tokens ``token_mask``
        (``[b, n]``, 1 = counts; None: all) keeps, as transformers sums them. ``rows_kept`` (``[b]`` bool; None:
        all): the rows that count at all (not those that repeat samples to even out a last eval batch over dp
        groups, which one process never sees)."""
        experts = self.num_experts
        device = router_logits[0].device
        counts = torch.zeros(experts, dtype=torch.float32, device=device)
        probs = torch.zeros(experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        keep = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
        if rows_kept is not None:
            tokens = router_logits[0].numel() // experts
            assert tokens % rows_kept.numel() == 0, (tokens, rows_kept.shape)
            by_row = rows_kept.to(device=device, dtype=torch.float32).repeat_interleave(tokens // rows_kept.numel())
            keep = by_row if keep is None else keep * by_row
        for layer in router_logits:
            weights = F.softmax(layer.reshape(-1, experts), dim=-1)  # [T, E]
            chosen = torch.topk(weights, self.top_k, dim=-1).indices  # [T, k]
            kept = keep if keep is not None else torch.ones(weights.shape[0], dtype=torch.float32, device=device)
            counts = counts.scatter_add(0, chosen.reshape(-1), kept.repeat_interleave(self.top_k))
            probs = probs + (weights.float() * kept[:, None]).sum(dim=0)
            rows = rows + kept.sum()
        return torch.cat([counts.detach(), probs, rows[None]])

    def loss(self, totals: torch.Tensor) -> torch.Tensor:
        """The loss from :meth:`statistics` summed over the ranks (``[2E + 1]``)."""
        experts = self.num_experts
        rows = totals[-1].clamp(min=1)
        return experts * torch.sum((totals[:experts] / rows) * (totals[experts : 2 * experts] / rows))


def _check(causal_lm: nn.Module, aux: RouterAuxLoss, theirs) -> None:
    """ValueError unless the model's own ``load_balancing_loss_func`` (``theirs``) is the loss
    :class:`RouterAuxLoss` computes (checked on random router logits, with and without a mask)."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, aux.num_experts, generator=generator) for _ in range(2))
    for mask in (None, torch.tensor([[1, 1, 0], [1, 1, 1]])):
        want = torch.as_tensor(theirs(logits, aux.num_experts, aux.top_k, mask), dtype=torch.float64)
        got = aux.loss(aux.statistics(logits, mask).double())
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
            raise ValueError(
                f"{type(causal_lm).__name__}'s load-balancing loss is not the Switch-Transformer form ulysses-sp "
                f"computes over the whole sequence ({float(want):.6g} vs {float(got):.6g} on a probe); set "
                "model.config.output_router_logits = False"
            )


def router_aux_loss(model: nn.Module) -> RouterAuxLoss | None:
    """The load-balancing loss ``model`` adds to its loss: None unless ``config.output_router_logits`` and its
    module defines ``load_balancing_loss_func`` (DeepSeek-V3, GLM-4-MoE add none: their loss is the
    cross-entropy alone).

    Read from the causal LM as transformers reads it (``num_experts``, ``num_experts_per_tok``,
    ``router_aux_loss_coef``) and checked once against the model's own function (ValueError when it differs or
    the attributes are missing).
    """
    causal_lm = find_causal_lm(model, "the MoE load-balancing loss")
    if not getattr(text_config(causal_lm), "output_router_logits", False):
        return None
    theirs = getattr(sys.modules.get(own_class(causal_lm).__module__), "load_balancing_loss_func", None)
    if theirs is None:
        return None
    values = [getattr(causal_lm, k, None) for k in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if any(v is None for v in values):
        raise ValueError(
            f"{type(causal_lm).__name__} adds a load-balancing loss (output_router_logits=True) but has no "
            "num_experts / num_experts_per_tok / router_aux_loss_coef, so ulysses-sp cannot compute it over the "
            "whole sequence; set model.config.output_router_logits = False"
        )
    aux = RouterAuxLoss(int(values[0]), int(values[1]), float(values[2]))
    if causal_lm.__dict__.get(_STATE_ATTR) != aux:  # checked once per setting
        _check(causal_lm, aux, theirs)
        causal_lm.__dict__[_STATE_ATTR] = aux
    return aux
