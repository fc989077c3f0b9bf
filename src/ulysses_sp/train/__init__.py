"""Training recipe behind ``ulysses-sp train``.

run.py            the command's flow: resolve once, then one process, local ranks, or another launcher's rank
runspec.py        RunSpec: the run resolved and checked before any rank trains (config, model, resume point)
config.py         TrainConfig: every field is a CLI flag and a YAML key
launch.py         our local launcher (ranks, signals, one error line); torchrun / accelerate / Slurm environments
lifeline.py       a rank dies with its launcher; SIGTERM as a flag, Ctrl-C without a traceback
outdir.py         the output directory: checks, one run at a time (flock), an earlier run's files
errors.py         failures as one line a user can act on (bad input, full disk, non-finite training)
dataset_files.py  the files a --dataset names (skipped kinds, hidden and empty files)
documents.py      documents -> tokens (load, name, tokenize, split); the tokenizer
data.py           tokens -> packed (or windowed) rows; dp-sharded, resumable loader
model_factory.py  built-in demo Llamas, HF models, FSDP2 (meta init + broadcast from rank 0) or DDP
optim.py          AdamW, warm-up + cosine LR, planned steps
loop.py           Trainer: steps with gradient accumulation, SP eval, checkpoints, resume, agreed stops
checkpoint.py     atomic checkpoints (HF model, DCP-sharded optimizer, RNG, data position), keep-last-N, set-aside
integrity.py      checksums of every checkpoint file, verified before a resume
rng.py            RNG states captured into checkpoints
metrics.py        tokens/s, TFLOPs, MFU, memory, the JSONL log, the progress display, the summary
tracking.py       --report-to tensorboard|wandb, the loss-curve PNG
faults.py         test-only fault injection (a rank dies, pauses, or is killed mid-checkpoint)
"""
