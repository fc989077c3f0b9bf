"""A plain PyTorch training loop with Ulysses sequence parallelism (sp=2 on 2 CPU processes).

    torchrun --nproc-per-node 2 examples/train_plain_pytorch.py

Each step, every rank of the SP group takes the SAME full batch, keeps its slice of the sequence, and the
two all-to-alls inside every attention layer give each rank the full sequence for half of the heads.
The printed loss equals what one process would compute on the whole sequence.
"""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses_sp

SEQ_LEN, STEPS = 2048, 20

layout = ulysses_sp.ParallelLayout.from_env(sp=2)  # world = dp x sp; here dp = 1
torch.manual_seed(0)  # same initial weights on every rank
config = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ_LEN,
)
model = ulysses_sp.parallelize(LlamaForCausalLM(config), layout)
# the long-sequence memory features `ulysses-sp train` runs: tiled lm_head + loss, tiled MLP, checkpointing
ulysses_sp.apply_features(model, ulysses_sp.Features(), layout.device.type)
# DDP over the whole world averages gradients over dp x sp: that is the reduction the loss expects.
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

# A toy data set with structure to learn: 4 random token patterns, repeated to SEQ_LEN. SP groups (dp ranks)
# see different samples; replace this with your data loader.
data = torch.Generator().manual_seed(1234 + layout.dp_rank)
patterns = torch.randint(0, config.vocab_size, (4, 64), generator=data)
for step in range(STEPS):
    full = {"input_ids": patterns[step % 4 : step % 4 + 1].repeat(1, SEQ_LEN // 64)}
    full["labels"] = full["input_ids"].clone()

    shard = ulysses_sp.shard_batch(full, layout)  # this rank's tokens, shifted labels, global positions
    loss = ulysses_sp.causal_lm_loss(model, shard, layout)  # token-weighted over every shard and replica
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if layout.is_main:
        print(f"step {step:3d}  loss {loss.item():.4f}  (tokens/step {SEQ_LEN}, {SEQ_LEN // layout.sp} per rank)")

# End with the process group, as torch asks (docs/library.md says what else happens at exit on CPU).
torch.distributed.destroy_process_group()
