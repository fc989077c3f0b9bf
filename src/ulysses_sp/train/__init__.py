"""Training recipe behind ``ulysses-sp train``.

config.py         TrainConfig: every field is a CLI flag and a YAML key
data.py           documents -> tokens -> packed (or windowed) rows; dp-sharded, resumable loader
model_factory.py  built-in demo Llamas, HF models, FSDP2 (meta init + broadcast from rank 0) or DDP
optim.py          AdamW, warm-up + cosine LR, planned steps
loop.py           Trainer: steps with gradient accumulation, SP eval, checkpoints, resume
checkpoint.py     atomic checkpoints (HF model, DCP-sharded optimizer, RNG, data position), keep-last-N
metrics.py        tokens/s, TFLOPs, MFU, memory, the JSONL log, the progress display, the summary
launch.py         local ranks via torch's elastic launcher; torchrun / accelerate / Slurm environments
faults.py         test-only fault injection (a rank dies, pauses, or is killed mid-checkpoint)
"""
