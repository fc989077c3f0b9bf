"""Ulysses sequence parallelism for TRL's ``SFTTrainer``: ``UlyssesSFTTrainer(..., sp_size=4)``.

TRL's padding-free packing (``SFTConfig(packing=True)`` or ``padding_free=True``) emits one packed row per
batch with ``position_ids`` that restart at 0 for every document; the wrapped collator keeps them (made
global only where the sequence is padded) so attention never crosses a document, and drops the full-row
``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` keys, which would be stale for a shard. TRL's fused LM head
scores the pre-shifted ``shift_labels`` as they are, so its loss, entropy and token-accuracy metrics come out
right over the shards.
"""

from __future__ import annotations

from trl import SFTTrainer

from .hf_trainer import UlyssesTrainerMixin

__all__ = ["UlyssesSFTTrainer"]


class UlyssesSFTTrainer(UlyssesTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with Ulysses sequence parallelism; extra arguments ``sp_size`` and ``sp_core``.

    See :class:`~ulysses_sp.integrations.hf_trainer.UlyssesTrainerMixin`. ``SFTConfig.pad_to_multiple_of`` is
    not needed: the sequence is padded to a multiple of ``sp_size`` when it is split. TRL's own fused LM head
    computes the loss without the full logits, so the library's tiled loss stays off here.
    """

    sp_tiled_loss_default = False
