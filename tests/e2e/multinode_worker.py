"""One rank of the two-node run of tests/e2e/test_multinode.py, started by torchrun (2 agents x 2 processes).

The model has 2 query heads and 1 kv head, so sp=4 is ulysses 2 x ring 2; with LOCAL_WORLD_SIZE=2 each Ulysses
group must be the two processes of one "node" (torchrun's GROUP_RANK) and each ring must cross the nodes. Two
SGD steps (packed documents, then padding) are compared with one process on the full batch: loss and every
gradient, fp32. Writes ``rank{RANK}.json`` (``{"ok": ...}`` or ``{"error": traceback}``) into the folder given.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import ulysses_sp as U
from tests.helpers.models import build, make_batch

TOL = dict(rtol=1e-5, atol=1e-6)
BATCHES = (dict(packed=(11, 21)), dict(pad="right"))


def _nodes(group: dist.ProcessGroup) -> list[int]:
    mine = torch.tensor([int(os.environ["GROUP_RANK"])])
    nodes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(nodes, mine, group=group)
    return [int(n) for n in nodes]


def _steps(model: torch.nn.Module, layout: U.ParallelLayout | None) -> list[tuple[torch.Tensor, dict]]:
    """Loss and (world-averaged) gradients of each SGD step; ``layout=None``: the plain transformers model on the
    full batch, its own loss (the one-process reference)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    results = []
    for step, shape in enumerate(BATCHES):
        batch = make_batch(2, 32, seed=10 + step, **shape)
        optimizer.zero_grad(set_to_none=True)
        if layout is None:
            loss = model(**batch, use_cache=False).loss
            loss.backward()
        else:
            loss = U.causal_lm_loss(model, U.shard_batch(batch, layout), layout)
            loss.backward()
            U.sync_gradients(model, layout)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
    return results


def run() -> dict[str, object]:
    layout = U.ParallelLayout.from_env(sp=4, num_heads=2, num_kv_heads=1)  # node size from LOCAL_WORLD_SIZE
    assert os.environ["LOCAL_WORLD_SIZE"] == "2" and (layout.ulysses, layout.ring) == (2, 2), layout
    ulysses_nodes, ring_nodes = _nodes(layout.ulysses_group), _nodes(layout.ring_group)
    assert len(set(ulysses_nodes)) == 1, f"a Ulysses group spans nodes {ulysses_nodes}"
    assert sorted(ring_nodes) == [0, 1], f"a ring stays on nodes {ring_nodes}"
    model = build("llama", heads=2, kv_heads=1)
    reference = _steps(copy.deepcopy(model), None)  # one process, full batch, plain transformers
    parallel = _steps(U.parallelize(model, layout), layout)
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(parallel, reference, strict=True)):
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, s=step: f"step {s} loss: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
    return {"losses": [float(loss) for loss, _ in parallel], "ulysses_nodes": ulysses_nodes, "ring_nodes": ring_nodes}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        report: dict[str, object] = {"ok": run()}
    except Exception:  # written for the test to show
        report = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
