"""The one-process reference of a random Accelerate case (tests/integrations/cases_random_accelerate.py).

The same model (same seed), optimizer and scheduler, the same samples per optimizer step, the plain model's
logits and a plain cross-entropy (label-smoothed where the case draws it). What a micro-batch is: accelerate deals
the dataloader's batches round-robin over the ``dp`` SP groups (batch ``j`` to dp rank ``j % dp``), so micro-batch
``t`` of an epoch is batches ``t*dp .. t*dp + dp - 1`` together (with dp > 1 the last completed with samples from
the start, as accelerate evens it out). Its loss is the library's (docs/integrations.md, src/ulysses_sp/loss.py): the
sum of the token losses of the whole global micro-batch (every dp rank's rows) over its valid-token count, or over
the optimizer step's count when the case passes ``num_items_in_batch``; plus, in the ``loss_fn(model, batch)``
form, an MoE's ``router_aux_loss_coef x aux`` over that global micro-batch. Accelerate divides each loss by the
accumulation steps (a partial last group too). The scheduler steps ``dp`` times per optimizer step, as accelerate
steps it under plain DDP over ``dp`` processes (the samples of a step are those of ``dp`` data-parallel ranks);
under ``split_batches`` once (the dataloader's batch is then the global micro-batch, split over the dp groups).
The eval losses are those of the eval set's global micro-batches, in eval mode without gradients.

That global token mean is the library's definition. Plain Accelerate DDP without SP averages each rank's own
token mean instead, which differs whenever the dp ranks' micro-batches hold different numbers of targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.integrations.cases_random_accelerate import (
    aux_on,
    dataset,
    groups,
    loader,
    model,
    optimizer_and_scheduler,
    trained_weights,
)
from tests.integrations.common import pad_collate


def global_batches(case: dict, samples: list[dict], batch: int) -> list[list[dict]]:
    """The global micro-batches of ``samples`` read ``batch`` per dp SP group (batch ``t*dp + r`` on dp rank ``r``,
    or under split_batches the dataloader's ``batch x dp`` split over them: the same samples). With dp > 1
    accelerate evens the last one out with samples from the start, as under plain DDP (docs/integrations.md)."""
    size = batch * case["dp"]
    if case["dp"] > 1:
        need = -(-len(samples) // size) * size
        samples = [samples[i % len(samples)] for i in range(need)]
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def _targets(features: list[dict]) -> int:
    return sum(sum(label != -100 for label in f["labels"][1:]) for f in features)


def _loss(case: dict, net: torch.nn.Module, features: list[dict], denominator: int, coef: float | None):
    """The global micro-batch's token-loss sum over ``denominator``, plus the MoE term (``coef``) where the loss
    function runs the model. Rows right-padded together: every real token sees what it sees under any padding."""
    batch = pad_collate(features)
    out = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    options = dict(ignore_index=-100, reduction="sum", label_smoothing=case["smoothing"])
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **options)
    loss = loss / max(denominator, 1)
    if coef is not None and case["form"] == "model":
        loss = loss + coef * out.aux_loss
    return loss


def reference(case: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The case in this process (no process group): what :func:`train` measures, and the trained weights."""
    net = model(case)
    base = net.get_base_model() if case["lora"] else net
    coef = base.router_aux_loss_coef if aux_on(case, base) else None
    optimizer, scheduler = optimizer_and_scheduler(case, net)
    data = loader(case, collate_fn=list)
    result: dict[str, list] = {"losses": [], "grad_norms": [], "lrs": [], "evals": []}

    def evaluate(when: str) -> None:
        if when in case["evals"]:
            net.eval()
            with torch.no_grad():
                batches = global_batches(case, dataset(case, case["eval_lengths"]), case["eval_batch"])
                result["evals"].append([_loss(case, net, f, _targets(f), coef).item() for f in batches])
            net.train()

    evaluate("before")
    net.train()
    _train(case, net, optimizer, scheduler, data, coef, result, evaluate)
    evaluate("after")
    return result, trained_weights(net)


def _train(case, net, optimizer, scheduler, data, coef, result, evaluate) -> None:
    """The training loop; returns where the case stops (``max_steps`` steps or ``max_micro`` micro-batches)."""
    losses = result["losses"]
    # split_batches: one dataloader batch per optimizer step, so one scheduler step; else dp (as accelerate does)
    scheduler_steps = 0 if scheduler is None else 1 if case["split"] else case["dp"]
    for _ in range(case["epochs"]):
        samples = [sample for batch in data for sample in batch]  # this epoch's order
        for group in groups(global_batches(case, samples, case["batch"]), case["accum"]):
            step_targets = sum(_targets(features) for features in group)
            for i, features in enumerate(group):
                if case["weighting"] == "step":
                    loss = _loss(case, net, features, step_targets, coef)
                    loss.backward()
                else:
                    loss = _loss(case, net, features, _targets(features), coef)
                    (loss / case["accum"]).backward()
                losses.append(loss.item())
                if len(losses) == case["max_micro"] and i < len(group) - 1:
                    return  # stopped inside the group: its gradients are never stepped
            if case["clip"] is not None:
                params = [p for p in net.parameters() if p.requires_grad]
                result["grad_norms"].append(torch.nn.utils.clip_grad_norm_(params, case["clip"]).item())
            optimizer.step()
            for _ in range(scheduler_steps):
                scheduler.step()
            optimizer.zero_grad()
            result["lrs"].append(optimizer.param_groups[0]["lr"])
            if len(result["lrs"]) == 1:
                evaluate("between")
            if len(result["lrs"]) == case["max_steps"] or len(losses) == case["max_micro"]:
                return
