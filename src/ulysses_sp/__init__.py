"""ulysses-sp: Ulysses sequence parallelism for Hugging Face causal LMs on plain PyTorch.

The three calls a user needs::

    layout = ParallelLayout.from_env(sp=4)          # world = dp x sp, from torchrun's environment
    model = parallelize(model, layout)               # Ulysses attention through transformers' interface
    shard = shard_batch(batch, layout)               # this rank's tokens, shifted labels, global positions
    apply_features(model, Features(), "cuda")        # optional: tiled loss and MLP, checkpoints (offloaded)
    loss = causal_lm_loss(model, shard, layout)      # token-weighted over every shard and replica

Gradients come out right once averaged over dp x sp (DDP / FSDP2 over the world, or ``sync_gradients``).

Names are imported on first use (PEP 562): ``import ulysses_sp``, a command's ``--help`` and a bad flag import no
transformers, and ``ulysses-sp plan`` only its configuration classes, not its model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from .comm import CommStats
    from .cores import CORES, Segments
    from .features import Features, apply_features
    from .layout import ParallelLayout, choose_layout, choose_ring_degree
    from .loss import (
        causal_lm_loss,
        count_valid_tokens,
        reduce_token_loss,
        sequence_parallel_cross_entropy,
        sync_gradients,
    )
    from .model import parallelize, plain_attention, ulysses_context, unparallelize
    from .offload import disable_activation_checkpointing, enable_activation_checkpointing
    from .process_group import init_default_group
    from .sharding import gather_sequence, shard_batch, shift_labels
    from .tiled_loss import disable_tiled_loss, enable_tiled_loss, tiled_cross_entropy_sum
    from .tiled_norms import disable_tiled_norms, enable_tiled_norms
    from .tiling import disable_tiled_mlp, enable_tiled_mlp

__version__ = "0.1.0"

# the public names, by the module that defines each
_EXPORTS = {
    ".comm": ("CommStats",),
    ".cores": ("CORES", "Segments"),
    ".features": ("Features", "apply_features"),
    ".layout": ("ParallelLayout", "choose_layout", "choose_ring_degree"),
    ".loss": (
        "causal_lm_loss",
        "count_valid_tokens",
        "reduce_token_loss",
        "sequence_parallel_cross_entropy",
        "sync_gradients",
    ),
    ".model": ("parallelize", "plain_attention", "ulysses_context", "unparallelize"),
    ".offload": ("disable_activation_checkpointing", "enable_activation_checkpointing"),
    ".process_group": ("init_default_group",),
    ".sharding": ("gather_sequence", "shard_batch", "shift_labels"),
    ".tiled_loss": ("disable_tiled_loss", "enable_tiled_loss", "tiled_cross_entropy_sum"),
    ".tiled_norms": ("disable_tiled_norms", "enable_tiled_norms"),
    ".tiling": ("disable_tiled_mlp", "enable_tiled_mlp"),
}
__all__ = [
    "CORES",
    "CommStats",
    "Features",
    "ParallelLayout",
    "Segments",
    "apply_features",
    "causal_lm_loss",
    "choose_layout",
    "choose_ring_degree",
    "count_valid_tokens",
    "disable_activation_checkpointing",
    "disable_tiled_loss",
    "disable_tiled_mlp",
    "disable_tiled_norms",
    "enable_activation_checkpointing",
    "enable_tiled_loss",
    "enable_tiled_mlp",
    "enable_tiled_norms",
    "gather_sequence",
    "init_default_group",
    "parallelize",
    "plain_attention",
    "reduce_token_loss",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shift_labels",
    "sync_gradients",
    "tiled_cross_entropy_sum",
    "ulysses_context",
    "unparallelize",
]


_HOME, __getattr__, __dir__ = lazy_exports(globals(), _EXPORTS, submodules=True)
