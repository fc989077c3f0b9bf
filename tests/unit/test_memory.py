"""PeakMemory on the CPU counts what a block allocates, views once, and frees."""

import torch
import torch.nn.functional as F

from ulysses_sp.memory import PeakMemory

MiB = 2**20


def test_counts_allocations_views_and_frees():
    with PeakMemory("cpu") as peak:
        a = torch.empty(8 * MiB // 4)
        view = a[16:]  # the same storage: not counted again
        del a
        b = torch.empty(4 * MiB // 4)
        del view, b
        c = torch.empty(2 * MiB // 4)
        del c
    assert peak.peak_bytes == 12 * MiB


def test_cross_entropy_backward_holds_three_logit_sized_tensors():
    # logits -> log_softmax (saved) -> its gradient and the logits' gradient exist together in backward
    x = torch.randn(512, 32, requires_grad=True)
    w = torch.randn(1000, 32, requires_grad=True)
    y = torch.randint(0, 1000, (512,))
    logits_bytes = 512 * 1000 * 4
    with PeakMemory("cpu") as peak:
        F.cross_entropy(F.linear(x, w), y).backward()
    assert 3 * logits_bytes <= peak.peak_bytes < 3.2 * logits_bytes
