"""ulysses-sp: Ulysses sequence parallelism for Hugging Face causal LMs on plain PyTorch.

The three calls a user needs::

    layout = ParallelLayout.from_env(sp=4)          # world = dp x sp, from torchrun's environment
    model = parallelize(model, layout)               # Ulysses attention through transformers' interface
    shard = shard_batch(batch, layout)               # this rank's tokens, shifted labels, global positions
    logits = model(**{k: shard[k] for k in ("input_ids", "position_ids")}).logits
    loss = sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)

Gradients come out right once averaged over dp x sp (DDP / FSDP2 over the world, or ``sync_gradients``).
"""

from .comm import CommStats
from .cores import CORES, Segments
from .layout import ParallelLayout
from .loss import count_valid_tokens, sequence_parallel_cross_entropy, sync_gradients
from .model import parallelize, plain_attention, ulysses_context, unparallelize
from .sharding import shard_batch, shift_labels

__version__ = "0.1.0"

__all__ = [
    "CORES",
    "CommStats",
    "ParallelLayout",
    "Segments",
    "count_valid_tokens",
    "parallelize",
    "plain_attention",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shift_labels",
    "sync_gradients",
    "ulysses_context",
    "unparallelize",
]
