"""PeakMemory on the CPU counts what a block allocates, views once, and frees; older storages only as they grow."""

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from ulysses_sp.memory import PeakMemory, _StorageTracker
from ulysses_sp.standin import fake_world

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


def test_an_older_tensor_read_through_a_view_costs_nothing():
    w, h = torch.randn(4096, 64), torch.randn(256, 64)  # F.linear reads w through w.t()
    with PeakMemory("cpu") as peak:
        F.linear(h, w)
    assert peak.peak_bytes == 256 * 4096 * 4


def test_a_gradient_that_existed_before_costs_nothing_when_backward_adds_to_it():
    """A leaf's .grad may have no Python object (it was never read), yet backward accumulates into it in place;
    it is older than the block, so it must not be counted as the block's (it was, and held the peak up)."""
    n = 1 << 20
    w = torch.randn(n, requires_grad=True)
    (w * w).sum().backward()
    with PeakMemory() as peak:
        (w * w).sum().backward()  # product, its gradient and the sum of the two partial gradients: <= 3n
        later = torch.ones(3 * n)  # held after backward: 3n, not 3n plus the old gradient
    del later
    assert 3 * n * 4 <= peak.peak_bytes <= 3 * n * 4 + 64, peak.peak_bytes / (4 * n)  # + the scalar loss


def test_a_storage_freed_on_another_thread_is_subtracted():
    n = 1 << 18
    with PeakMemory() as peak:
        held = [torch.ones(n) for _ in range(4)]
        freeing = threading.Thread(target=held.clear)
        freeing.start()
        freeing.join()
        later = torch.ones(4 * n)
    del later
    assert peak.peak_bytes == 4 * n * 4, peak.peak_bytes / (4 * n)


def test_a_free_run_by_the_collector_inside_the_trackers_own_count_does_not_hang():
    """A garbage collection can start at any allocation, also while the tracker holds its lock to count a storage,
    and run a storage's finalizer (the tracker's _free) on the same thread: it used to wait for that lock forever
    (seen in tests/unit/test_checkpoint_placement.py). Here the count's storage frees another one midway."""
    tracker = _StorageTracker("cpu")
    tracker._count(1, torch.ones(4).untyped_storage())

    class FreesAnotherMidway:
        def nbytes(self) -> int:
            tracker._free(1)  # what a finalizer run by the collector at this point does
            return 8

        def data_ptr(self) -> int:
            return 0

    done = threading.Event()
    threading.Thread(target=lambda: (tracker._count(2, FreesAnotherMidway()), done.set()), daemon=True).start()
    assert done.wait(10), "the tracker waited for its own lock"
    assert tracker.current == 8 and tracker.peak == 16, (tracker.current, tracker.peak)


def test_fsdp2_parameters_gathered_and_freed_by_resizing_are_followed():
    """FSDP2 allocates each layer's unsharded weight by resizing its storage and frees it the same way."""
    from torch.distributed.fsdp import fully_shard

    layer_bytes = 1024 * 1024 * 4
    with fake_world(2):
        model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        x = torch.randn(16, 1024)
        model(x).sum().backward()  # the first step creates the unsharded storages
        model.zero_grad(set_to_none=True)
        with _StorageTracker("cpu") as tracker:
            model(x).sum().backward()
        grads = sum(p.grad.to_local().numel() * 4 for p in model.parameters())
    assert grads == 8 * layer_bytes // 2
    assert tracker.current == grads  # every unsharded weight and gradient was freed again
    # the sharded gradients, one layer's weight and gradient, their collective buffers; never all 8 weights
    assert tracker.peak <= grads + 4 * layer_bytes, (tracker.peak, grads)
