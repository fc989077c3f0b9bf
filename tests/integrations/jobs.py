"""Multi-rank jobs for the integration tests, run on gloo ranks by ``tests.helpers.harness.run_world``.

Each entry point (``world2_plain``, ``world2_sp``, ``world4``) runs several jobs in one spawn (start-up is the
expensive part) and returns ``{job: "ok" | traceback}`` per rank. Jobs write what they measured (per-step
logged losses, eval losses, step counts, saved models) under ``$ULYSSES_IT_OUT/<job>/``; the tests compare
those files with each other and with one-process references.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from tests.helpers.harness import run_cases
from tests.helpers.models import build, router_aux_on
from tests.integrations.common import (
    EVAL_LENGTHS,
    TRAIN_LENGTHS,
    argmax_and_top,
    checkpointing_arg,
    drop_labels_collate,
    embeds_collate,
    expect_error,
    first,
    no_target_trainer,
    pad_collate,
    sft_args,
    sft_moe_eval_kwargs,
    stream_trainer,
    token_dataset,
    token_metrics,
    tokenizer,
    train_losses,
    trainer_args,
    write_json,
)
from tests.integrations.loss_override import loss_override_sp2
from tests.integrations.refusals import refusal_in_worker_dp2_sp2, refusal_on_one_rank


def _out(job: str) -> str:
    return os.path.join(os.environ["ULYSSES_IT_OUT"], job)


def _record(job: str, trainer, **extra) -> None:
    """Losses and step counts from rank 0, and the final model saved by the trainer (all ranks take part)."""
    trainer.save_model(os.path.join(_out(job), "final"))
    if dist.get_rank() == 0:
        state = trainer.state
        write_json(
            os.path.join(_out(job), "result.json"),
            {
                "losses": train_losses(state.log_history),
                "grad_norms": [e["grad_norm"] for e in state.log_history if "grad_norm" in e],
                "global_step": state.global_step,
                "epoch": state.epoch,
                "total_flos": state.total_flos,
                "tokens_seen": state.num_input_tokens_seen,
                **extra,
            },
        )


def trainer_metrics(job: str, sp: int, include_for_metrics: list[str] | None = None, **kwargs) -> None:
    """UlyssesTrainer evaluating and predicting with compute_metrics (an untrained model, no training): rank 0 writes
    the metrics and the predictions."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = UlyssesTrainer(
        model=build("llama"),
        args=trainer_args(_out(job), include_for_metrics=include_for_metrics or []),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
        compute_metrics=token_metrics,
        sp_size=sp,
        **kwargs,
    )
    metrics = trainer.evaluate()
    predicted = trainer.predict(token_dataset(EVAL_LENGTHS, seed=2))
    unlabelled = token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels")
    bare = trainer.predict(unlabelled)  # logits alone, as one process gives them
    bare_metrics = trainer.evaluate(unlabelled)
    if dist.get_rank() == 0:
        results = {"metrics": metrics, "predict": predicted.metrics, "bare": bare.metrics, "bare_eval": bare_metrics}
        write_json(os.path.join(_out(job), "result.json"), results)
        torch.save(
            {
                "predictions": torch.as_tensor(first(predicted.predictions)),
                "labels": torch.as_tensor(predicted.label_ids),
                "bare": torch.as_tensor(first(bare.predictions)),
                "bare_labels": bare.label_ids,
            },
            os.path.join(_out(job), "predicted.pt"),
        )


class BatchInputs:
    """A ``compute_metrics`` for ``batch_eval_metrics=True`` with ``include_for_metrics=["inputs", "loss"]``: keeps
    each batch's ``inputs`` (a dict of tensors, as the evaluation loop hands it on) and losses."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def __call__(self, prediction, compute_result: bool) -> dict[str, float]:
        kept = {key: torch.as_tensor(value).cpu() for key, value in prediction.inputs.items()}
        self.batches.append({"inputs": kept, "losses": torch.as_tensor(prediction.losses).cpu()})
        return {"batches": float(len(self.batches))} if compute_result else {}


def batch_eval_inputs(trainer_class, out: str, **kwargs):
    """Evaluate an untrained model batch by batch (``batch_eval_metrics``) with the inputs and losses included:
    the batches that :class:`BatchInputs` kept (left-padded rows, as a generation-style collator gives them)."""
    from tests.integrations.cases_random import left_pad_collate

    metrics = BatchInputs()
    args = trainer_args(out, batch_eval_metrics=True, include_for_metrics=["inputs", "loss"])
    trainer = trainer_class(
        model=build("llama"),
        args=args,
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=left_pad_collate,
        compute_metrics=metrics,
        **kwargs,
    )
    trainer.evaluate()
    return metrics.batches


def batch_eval_inputs_sp2() -> None:
    """:func:`batch_eval_inputs` under SP=2: rank 0 saves the batches."""
    from ulysses_sp.integrations import UlyssesTrainer

    batches = batch_eval_inputs(UlyssesTrainer, _out("batch_eval_inputs_sp2"), sp_size=2)
    if dist.get_rank() == 0:
        torch.save(batches, os.path.join(_out("batch_eval_inputs_sp2"), "batches.pt"))


MOE_IGNORED = ["aux_loss", "router_logits"]


def trainer_metrics_moe(job: str, sp: int) -> None:
    """An MoE model whose outputs hold aux_loss and router_logits beside the logits (one process would hand them to
    compute_metrics as a tuple): refused on every rank; with them in ignore_keys, rank 0 writes the metrics."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = UlyssesTrainer(
        model=moe_model(),
        args=trainer_args(_out(job)),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
        compute_metrics=token_metrics,
        sp_size=sp,
    )
    try:
        trainer.evaluate()
    except ValueError as error:
        assert "pass ignore_keys=['aux_loss', 'router_logits']" in str(error), error
    else:
        raise AssertionError("predictions without their aux_loss and router_logits were not refused")
    metrics = trainer.evaluate(ignore_keys=MOE_IGNORED)
    if dist.get_rank() == 0:
        write_json(os.path.join(_out(job), "result.json"), {"metrics": metrics})


def lora_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def peft_model(kind: str):
    """The tiny Llama with a PEFT adapter of another kind than plain LoRA: ``dora``, ``ia3``, ``adaption``
    (LLaMA-Adapter's adaption prompt, on the last layer), ``modules_to_save`` (LoRA training copies of lm_head and
    the embedding too: the tiled loss runs in the copy), ``trainable_tokens`` (a few embedding rows trained) or
    ``lora_lm_head`` (LoRA on lm_head too: the tiled loss runs with W + scaling x B @ A)."""
    import peft

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    configs = {
        "modules_to_save": lambda: peft.LoraConfig(**lora, modules_to_save=["lm_head", "embed_tokens"]),
        "trainable_tokens": lambda: peft.LoraConfig(**lora, trainable_token_indices={"embed_tokens": [5, 6, 7]}),
        "lora_lm_head": lambda: peft.LoraConfig(**{**lora, "target_modules": ["q_proj", "v_proj", "lm_head"]}),
        "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
        "ia3": lambda: peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "adaption": lambda: peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=1, task_type="CAUSAL_LM"),
    }
    torch.manual_seed(0)  # the adapters' own initial weights
    return peft.get_peft_model(build("llama"), configs[kind]())


PEFT_KINDS = ("dora", "ia3", "adaption", "modules_to_save", "trainable_tokens", "lora_lm_head")


def peft_kinds_sp2() -> None:
    """Each of PEFT_KINDS under SP=2: three steps and an eval each; rank 0 writes the losses."""
    from ulysses_sp.integrations import UlyssesTrainer

    found = {}
    for kind in PEFT_KINDS:
        trainer = UlyssesTrainer(
            model=peft_model(kind),
            args=trainer_args(_out("peft_kinds_sp2"), max_steps=3, learning_rate=1e-2),
            train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
            eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
            data_collator=pad_collate,
            sp_size=2,
        )
        trainer.train()
        found[kind] = {"losses": train_losses(trainer.state.log_history), "eval_loss": trainer.evaluate()["eval_loss"]}
    if dist.get_rank() == 0:
        write_json(os.path.join(_out("peft_kinds_sp2"), "result.json"), found)


def moe_model():
    """A tiny Mixtral whose loss adds its load-balancing term (weighted 0.5, so that one computed from a shard alone
    would show in the losses)."""
    return router_aux_on(build("mixtral", kv_heads=2))


# ----------------------------------------------------------------------------------------------- trainer jobs
def plain_trainer(job: str, model=None, **args) -> None:
    """Reference: the plain transformers Trainer (DP over every rank); ``model``: the tiny Llama by default."""
    from transformers import Trainer

    trainer = Trainer(
        model=model if model is not None else build("llama"),
        args=trainer_args(_out(job), **args),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
        data_collator=pad_collate,
    )
    trainer.train()
    _record(job, trainer)


def fsdp2_model():
    """The tiny Llama sharded with FSDP2 over the world at load time (transformers' DistributedConfig)."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    path = os.path.join(os.environ["ULYSSES_IT_OUT"], "tiny_llama")
    if dist.get_rank() == 0:
        build("llama").save_pretrained(path)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size())
    )
    assert type(model.lm_head.weight).__name__ == "DTensor"
    return model


def ulysses_trainer(
    job: str,
    sp: int,
    model=None,
    eval_samples: int = len(EVAL_LENGTHS),
    resume_from: str | None = None,
    collator=pad_collate,
    **args,
) -> None:
    """UlyssesTrainer with an eval set of long, odd-length sequences, checkpoints every 4 steps."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = UlyssesTrainer(
        model=model if model is not None else build("llama"),
        args=trainer_args(_out(job), save_strategy="steps", save_steps=4, **args),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
        eval_dataset=token_dataset(EVAL_LENGTHS[:eval_samples], seed=2),
        data_collator=collator,
        sp_size=sp,
    )
    trainer.train(resume_from_checkpoint=resume_from)
    metrics = trainer.evaluate()
    _record(
        job,
        trainer,
        eval_loss=metrics["eval_loss"],
        eval_samples=eval_samples,
        train_batches=len(trainer.get_train_dataloader()),
    )


EMBEDS_ARGS = dict(num_train_epochs=1, include_num_input_tokens_seen="all")  # (with embeds_collate)


def trainer_stream(job: str) -> None:
    """UlyssesTrainer over streamed datasets of 4 shards (:func:`tests.integrations.common.stream_trainer`)."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = stream_trainer(UlyssesTrainer, _out(job), sp_size=2)
    trainer.train()
    _record(job, trainer, eval_loss=trainer.evaluate()["eval_loss"])


def no_targets(job: str) -> None:
    """UlyssesTrainer (the tiled loss) training and evaluating on data where one batch has no targets."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = no_target_trainer(UlyssesTrainer, _out(job), sp_size=2)
    trainer.train()
    metrics = trainer.evaluate()
    if dist.get_rank() == 0:
        steps = [[e["loss"], e["grad_norm"]] for e in trainer.state.log_history if "grad_norm" in e]
        weights = {n: p.detach().tolist() for n, p in trainer.model.named_parameters()}
        write_json(os.path.join(_out(job), "result.json"), {"steps": steps, "eval_loss": metrics["eval_loss"]})
        torch.save(weights, os.path.join(_out(job), "weights.pt"))


def ulysses_lora(job: str) -> None:
    """A PEFT LoRA model under SP=2 with GAS=2 and torch's reentrant activation checkpointing (under which DDP's
    search for unused parameters, transformers' default for a PEFT model, would fail), then an eval under SP."""
    from ulysses_sp.integrations import UlyssesTrainer

    trainer = UlyssesTrainer(
        model=lora_model(),
        args=trainer_args(
            _out(job),
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            learning_rate=1e-2,
            **{checkpointing_arg(): True, checkpointing_arg() + "_kwargs": {"use_reentrant": True}},
        ),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1),
        eval_dataset=token_dataset(EVAL_LENGTHS, seed=2),
        data_collator=pad_collate,
        sp_size=2,
    )
    trainer.train()
    _record(job, trainer, eval_loss=trainer.evaluate()["eval_loss"])


# ----------------------------------------------------------------------------------------------- TRL jobs
def sft_trainer(model, args, sp: int = 2):
    """UlyssesSFTTrainer(sp_size=sp) on the tiny training set."""
    from ulysses_sp.integrations import UlyssesSFTTrainer

    data = token_dataset(TRAIN_LENGTHS, seed=1).remove_columns("labels")
    return UlyssesSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(), sp_size=sp)


def sft(job: str, sp: int | None, model=None, eval_first: bool = False, options: dict | None = None, **args) -> None:
    """TRL SFTTrainer with padding-free packing: plain (sp=None) or UlyssesSFTTrainer(sp_size=sp, **options) with
    an eval (``eval_first``: before training too); ``model``: the tiny Llama by default."""
    from trl import SFTTrainer

    from ulysses_sp.integrations import UlyssesSFTTrainer

    kwargs = dict(
        model=model if model is not None else build("llama"),
        args=sft_args(_out(job), **args),
        train_dataset=token_dataset(TRAIN_LENGTHS, seed=1).remove_columns("labels"),
        processing_class=tokenizer(),
    )
    if sp is None:
        trainer = SFTTrainer(**kwargs)
        trainer.train()
        _record(job, trainer)
        return
    eval_dataset = token_dataset(EVAL_LENGTHS, seed=2).remove_columns("labels")
    options = options or {}
    first = {}
    if eval_first:  # on a trainer of its own: under several processes an evaluate() before train() changes the
        # steps after the first, plain DDP with TRL's SFTTrainer too (one process: not)
        fresh = UlyssesSFTTrainer(
            **{**kwargs, "model": copy.deepcopy(kwargs["model"])}, eval_dataset=eval_dataset, sp_size=sp, **options
        )
        first = {"eval_first": fresh.evaluate()}
    trainer = UlyssesSFTTrainer(**kwargs, eval_dataset=eval_dataset, sp_size=sp, **options)
    trainer.train()
    metrics = trainer.evaluate()
    _record(
        job, trainer, eval_loss=metrics["eval_loss"], eval_aux_loss=metrics.get("eval_aux_loss"), eval=metrics, **first
    )


def sft_moe_eval(job: str) -> None:
    """UlyssesSFTTrainer's eval of an MoE model with TRL's load-balancing term (:func:`sft_moe_eval_kwargs`)."""
    from ulysses_sp.integrations import UlyssesSFTTrainer

    metrics = UlyssesSFTTrainer(**sft_moe_eval_kwargs(_out(job)), sp_size=2).evaluate()
    if dist.get_rank() == 0:
        write_json(os.path.join(_out(job), "result.json"), {"eval_loss": metrics["eval_loss"]})


# ----------------------------------------------------------------------------------------------- bad input
def bad_input() -> None:
    """Each bad input raises a ValueError on every rank, before training (or at the first batch), no hang."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ulysses_sp.integrations import UlyssesTrainer

    data = token_dataset(TRAIN_LENGTHS[:4], seed=1)

    def make(model=None, collator=pad_collate, **kwargs):
        return UlyssesTrainer(
            model=model if model is not None else build("llama"),
            args=kwargs.pop("args", None) or trainer_args(_out("bad_input")),
            train_dataset=data,
            data_collator=collator,
            sp_size=kwargs.pop("sp_size", 2),
            **kwargs,
        )

    assert make(build("llama", heads=3)).sp_layout.ring == 2  # 3 heads over 2 ranks: ulysses 1 x ring 2
    expect_error(
        ValueError, "layouts of sp=2 that work: ulysses 1 x ring 2", lambda: make(build("llama", heads=3), sp_ring=1)
    )
    AttentionInterface.register("my_kernel", sdpa_attention_forward)
    expect_error(
        ValueError,
        "attn_implementation='my_kernel' has no Ulysses core",
        lambda: make(build("llama", attn="my_kernel")),
    )
    expect_error(ValueError, "unsupported attention core 'paged'", lambda: make(sp_core="paged"))
    expect_error(
        ValueError,
        "include_for_metrics=['nonsense']",
        lambda: make(args=trainer_args(_out("bad_input"), include_for_metrics=["nonsense", "loss"])),
    )
    expect_error(ValueError, "sp_size must be a positive int", lambda: make(sp_size=0))
    expect_error(ValueError, "not divisible by sp=4", lambda: make(sp_size=4))
    sharded = build("llama")
    fully_shard(sharded)  # by hand, not at load time: the Trainer would wrap its DTensor parameters in DDP
    expect_error(ValueError, "LlamaForCausalLM has DTensor parameters on a world of 2 ranks", lambda: make(sharded))
    trainer = make(collator=drop_labels_collate)
    expect_error(ValueError, "the collated batch has no 'labels'", trainer.train)


# ----------------------------------------------------------------------------------------------- accelerate jobs
def accelerate_loop(
    job: str, sp: int, fsdp2: bool = False, steps: int = 6, stream_shards: int = 0, worker: bool = False
) -> None:
    """A custom Accelerate loop through SequenceParallelConfig.prepare, on DDP or on FSDP2 (fully_shard); with
    ``stream_shards``, over the data as a ``datasets.IterableDataset`` of that many shards (accelerate gives each
    rank its own shards when there are as many as ranks); with ``worker``, collated in a dataloader worker started by
    forkserver."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from ulysses_sp.integrations import SequenceParallelConfig

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    model = build("llama")
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_dataset(TRAIN_LENGTHS, seed=1)
    workers = {"num_workers": 1, "multiprocessing_context": "forkserver"} if worker else {}
    if stream_shards:
        data = data.to_iterable_dataset(num_shards=stream_shards)
    loader = DataLoader(data, batch_size=2, collate_fn=pad_collate, **workers)
    model, optimizer, loader, loss_fn = SequenceParallelConfig(sp_size=sp).prepare(
        accelerator, model, optimizer, loader
    )
    batches = sum(1 for _ in loader) if stream_shards else len(loader)  # (a stream has no length)
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        if fsdp2:  # the recommended form: the model runs inside the loss function, with the tiled loss
            loss = loss_fn(model, batch)
        else:  # logits computed by the caller (the model's own untiled forward, no labels passed)
            inputs = {key: batch[key] for key in ("input_ids", "position_ids", "attention_mask")}
            loss = loss_fn(model(**inputs).logits, batch["shift_labels"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in accelerator.unwrap_model(model).named_parameters()
    }
    if dist.get_rank() == 0:
        write_json(os.path.join(_out(job), "result.json"), {"losses": losses, "batches": batches})
        torch.save(state, os.path.join(_out(job), "weights.pt"))


def accelerate_metrics(job: str, sp: int, ring: int | None = None) -> None:
    """An eval loop gathering per-sample ids (sequence_dim None) and the shards' tokens, targets and logits (whole
    sequences) with ``loss_fn.gather_for_metrics``, a bool mask and a scalar too; rank 0 writes what each rank got,
    in order. A per-sample tensor that differs inside an SP group is refused on every rank, as are unlike shards;
    ``accelerator.gather_for_metrics`` (made SP-aware by prepare) gives per-sample tensors and objects once and
    refuses shards and objects that differ inside an SP group."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ulysses_sp import gather_sequence
    from ulysses_sp.integrations import SequenceParallelConfig

    accelerator = Accelerator(cpu=True)
    data = token_dataset(EVAL_LENGTHS, seed=2).add_column("idx", list(range(len(EVAL_LENGTHS))))
    collate = lambda features: {**pad_collate(features), "idx": torch.tensor([f["idx"] for f in features])}  # noqa: E731
    model, loader, loss_fn = SequenceParallelConfig(sp_size=sp, ring=ring).prepare(
        accelerator, build("llama"), DataLoader(data, batch_size=2, collate_fn=collate)
    )
    model.eval()
    got = {"idx": [], "names": [], "input_ids": [], "shift_labels": [], "logits": []}
    with torch.no_grad():
        for batch in loader:
            inputs = {key: batch[key] for key in ("input_ids", "position_ids", "attention_mask")}
            logits = model(**inputs).logits
            (idx,) = loss_fn.gather_for_metrics(accelerator, (batch["idx"],))
            whole = loss_fn.gather_for_metrics(
                accelerator, {"input_ids": batch["input_ids"], "shift_labels": batch["shift_labels"], "logits": logits},
                sequence_dim=1,
            )  # fmt: skip
            # a bool per-token tensor (padded with False where the dp groups' rows differ in length) and a scalar
            valid = loss_fn.gather_for_metrics(accelerator, batch["shift_labels"] != -100, sequence_dim=1)
            assert torch.equal(valid, whole["shift_labels"] != -100)
            assert loss_fn.gather_for_metrics(accelerator, batch["idx"].sum()).numel() in (1, 2)
            # Accelerate's own, as prepare left it: per-sample tensors once per sample, a scalar from every rank
            assert torch.equal(accelerator.gather_for_metrics((batch["idx"],))[0], idx)
            assert accelerator.gather_for_metrics(torch.tensor(1.0)).tolist() == [1.0] * dist.get_world_size()
            # Python objects, once per sample as Accelerate gathers them (it turns to objects for non-tensors)
            names = [f"s{i}" for i in batch["idx"].tolist()]
            got["names"] += accelerator.gather_for_metrics(names)
            assert accelerator.gather_for_metrics(names, use_gather_object=True) == got["names"][-len(idx) :]
            got["idx"] += idx.tolist()
            for key in ("input_ids", "shift_labels", "logits"):
                got[key] += list(whole[key])
    # refused on every rank: a per-sample tensor that differs inside one SP group (dp group 1's with dp=2), and
    # shards of different ranks
    layout = loss_fn.layout
    mine = torch.tensor([layout.sp_rank * (layout.dp_rank if layout.dp > 1 else 1)])
    expect_error(
        ValueError,
        "hold different values for a per-sample tensor",
        lambda: loss_fn.gather_for_metrics(accelerator, mine),
    )
    expect_error(ValueError, "hold different objects", lambda: accelerator.gather_for_metrics([int(mine)]))
    shards = "use loss_fn.gather_for_metrics(accelerator, data, sequence_dim=1)"  # a shard is no sample
    expect_error(ValueError, shards, lambda: accelerator.gather_for_metrics(torch.full((2, 4), layout.sp_rank)))
    odd = torch.zeros(2, 4, 3) if layout.sp_rank == 0 else torch.zeros(2, 4)
    expect_error(
        ValueError, "dim=2 is not a dim of a tensor of shape (2, 4)", lambda: gather_sequence(odd, layout, dim=2)
    )
    if dist.get_rank() == 0:
        os.makedirs(_out(job), exist_ok=True)
        torch.save(got, os.path.join(_out(job), "gathered.pt"))


# ----------------------------------------------------------------------------------------------- entry points
def split_batches_refused_dp2_sp2() -> None:
    """Under split_batches each batch is split over the dp=2 SP groups: a train batch size, or the eval batch size of
    a trainer given an eval set, that does not split over them is refused on every rank when the trainer is made;
    without an eval set, when evaluate() builds its dataloader."""
    from ulysses_sp.integrations import UlyssesTrainer

    def make(eval_data=None, **sizes):
        sizes = {"per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, **sizes}
        args = trainer_args(_out("split_batches_refused_dp2_sp2"), accelerator_config={"split_batches": True}, **sizes)
        return UlyssesTrainer(
            model=build("llama"), args=args, data_collator=pad_collate, eval_dataset=eval_data, sp_size=2
        )

    data = token_dataset(EVAL_LENGTHS[:4], seed=2)
    expect_error(
        ValueError,
        "per_device_train_batch_size must be a multiple of 2, got 3",
        lambda: make(per_device_train_batch_size=3),
    )
    refusal = "per_device_eval_batch_size must be a multiple of 2, got 1"
    expect_error(ValueError, refusal, lambda: make(data, per_device_eval_batch_size=1))
    trainer = make(per_device_eval_batch_size=1)  # nothing to evaluate yet
    expect_error(ValueError, refusal, lambda: trainer.evaluate(data))


def neftune_sp2() -> None:
    """NEFTune under SP: the noise on a shard's input embeddings has the magnitude one process gives the whole batch,
    alpha / sqrt(N x hidden) (transformers' formula), not sqrt(sp) times it; none in evaluation."""
    from ulysses_sp.integrations import UlyssesTrainer

    alpha, model = 5.0, build("llama")
    widths, clean, seen = [], [], []

    def collate(features):  # the whole batch's length N, batch by batch (all collated here, in order)
        batch = pad_collate(features)
        widths.append(batch["input_ids"].shape[1])
        return batch

    model.get_input_embeddings().register_forward_hook(lambda module, args, out: clean.append(out.detach()))

    def noisy(module, args, kwargs):  # what reaches the first decoder layer: the embeddings and the noise
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden.detach() - clean[-1], module.training))

    model.model.layers[0].register_forward_pre_hook(noisy, with_kwargs=True)
    args = trainer_args(_out("neftune_sp2"), neftune_noise_alpha=alpha, max_steps=3)
    data = token_dataset(TRAIN_LENGTHS, seed=1)
    trainer = UlyssesTrainer(model=model, args=args, train_dataset=data, data_collator=collate, sp_size=2)
    trainer.train()
    trainer.evaluate(token_dataset(EVAL_LENGTHS[:2], seed=2))
    assert [training for _, training in seen] == [True] * 3 + [False], seen
    for (noise, _), width in zip(seen[:3], widths, strict=False):
        magnitude = alpha / (width * noise.shape[-1]) ** 0.5
        # the largest of a shard's hundreds of uniform draws lies within 3% of the magnitude (chance ~1e-8)
        assert 0.97 * magnitude <= noise.abs().max() <= magnitude * (1 + 1e-5), (noise.abs().max(), magnitude)
    assert seen[3][0].abs().max() == 0


# average_tokens_across_devices=False: each dp rank's loss over its own targets (plain DDP then averages the ranks'
# gradients)
OWN_TOKENS = dict(average_tokens_across_devices=False, num_train_epochs=1)


def sft_moe_own_tokens(job: str, sp: int | None) -> None:
    """:func:`sft` of a tiny Mixtral with TRL's load-balancing term (0.5) under :data:`OWN_TOKENS`."""
    sft(job, sp, model=build("mixtral", kv_heads=2), router_aux_loss_coef=0.5, **OWN_TOKENS)


def world2_plain() -> dict[str, str]:
    """References on 2 ranks: DP=2 / SP=1 / GAS=1 with the plain Trainer and the plain SFTTrainer; the same with
    average_tokens_across_devices=False (:data:`OWN_TOKENS`: the tiny Llama, with label smoothing too, an MoE with its
    load-balancing term under the Trainer and TRL's)."""
    return run_cases(
        {
            "trainer_dp2": lambda: plain_trainer("trainer_dp2"),
            "sft_dp2": lambda: sft("sft_dp2", None),
            "trainer_own_tokens_dp2": lambda: plain_trainer("trainer_own_tokens_dp2", **OWN_TOKENS),
            "trainer_moe_own_tokens_dp2": lambda: plain_trainer(
                "trainer_moe_own_tokens_dp2", model=moe_model(), **OWN_TOKENS
            ),
            "trainer_smoothed_own_tokens_dp2": lambda: plain_trainer(
                "trainer_smoothed_own_tokens_dp2", label_smoothing_factor=0.1, **OWN_TOKENS
            ),
            "sft_moe_own_tokens_dp2": lambda: sft_moe_own_tokens("sft_moe_own_tokens_dp2", None),
        }
    )


def world2_sp() -> dict[str, str]:
    """DP=1 / SP=2 runs on 2 ranks."""
    return run_cases(
        {
            "trainer_sp2_gas2": lambda: ulysses_trainer("trainer_sp2_gas2", 2, gradient_accumulation_steps=2),
            "trainer_fsdp2_sp2_gas2": lambda: ulysses_trainer(
                "trainer_fsdp2_sp2_gas2", 2, model=fsdp2_model(), gradient_accumulation_steps=2, save_only_model=True
            ),
            "trainer_sp2_resume": lambda: ulysses_trainer(
                "trainer_sp2_resume",
                2,
                resume_from=os.path.join(_out("trainer_sp2_gas2"), "checkpoint-4"),
                gradient_accumulation_steps=2,
            ),
            "sft_sp2_gas2": lambda: sft("sft_sp2_gas2", 2, gradient_accumulation_steps=2),
            "trainer_stream_sp2": lambda: trainer_stream("trainer_stream_sp2"),
            "lora_sp2": lambda: ulysses_lora("lora_sp2"),
            "no_targets_sp2": lambda: no_targets("no_targets_sp2"),
            "loss_override_sp2": loss_override_sp2,
            "neftune_sp2": neftune_sp2,
            "trainer_embeds_sp2": lambda: ulysses_trainer(
                "trainer_embeds_sp2", 2, collator=embeds_collate, **EMBEDS_ARGS
            ),
            "peft_kinds_sp2": peft_kinds_sp2,
            "trainer_metrics_sp2": lambda: trainer_metrics(  # tiled loss: 2 forwards
                "trainer_metrics_sp2", 2, include_for_metrics=["inputs", "loss"]
            ),
            "trainer_metrics_moe_sp2": lambda: trainer_metrics_moe("trainer_metrics_moe_sp2", 2),
            "batch_eval_inputs_sp2": batch_eval_inputs_sp2,
            "accelerate_ddp_sp2": lambda: accelerate_loop("accelerate_ddp_sp2", 2),
            "accelerate_fsdp2_sp2": lambda: accelerate_loop("accelerate_fsdp2_sp2", 2, fsdp2=True),
            "accelerate_stream_sp2": lambda: accelerate_loop("accelerate_stream_sp2", 2, stream_shards=4, worker=True),
            "accelerate_metrics_sp2": lambda: accelerate_metrics("accelerate_metrics_sp2", 2),
            "bad_input": bad_input,
            "refusal_on_one_rank": refusal_on_one_rank,
        }
    )


def world4() -> dict[str, str]:
    """DP=2 x SP=2 on 4 ranks."""
    return run_cases(
        {
            # 8 eval samples: with dp=2 a partial last batch would be evened out by accelerate (as under DDP)
            "trainer_dp2_sp2": lambda: ulysses_trainer("trainer_dp2_sp2", 2, eval_samples=8),
            "accelerate_dp2_sp2": lambda: accelerate_loop("accelerate_dp2_sp2", 2, steps=4),
            "accelerate_stream_dp2_sp2": lambda: accelerate_loop(
                "accelerate_stream_dp2_sp2", 2, steps=4, stream_shards=4
            ),
            "trainer_metrics_dp2_sp2": lambda: trainer_metrics(
                "trainer_metrics_dp2_sp2", 2, sp_tiled_loss=False, preprocess_logits_for_metrics=argmax_and_top
            ),
            "accelerate_metrics_dp2_sp2": lambda: accelerate_metrics("accelerate_metrics_dp2_sp2", 2),
            "accelerate_metrics_ulysses2_ring2": lambda: accelerate_metrics(
                "accelerate_metrics_ulysses2_ring2", 4, ring=2
            ),
            "sft_moe_aux_dp2_sp2_gas2": lambda: sft(
                "sft_moe_aux_dp2_sp2_gas2",
                2,
                model=build("mixtral", kv_heads=2),
                router_aux_loss_coef=0.5,
                gradient_accumulation_steps=2,
                eval_first=True,
                # TRL's fused LM head in training; in evaluation the logits for compute_metrics come from a forward
                # without the targets (with them the tiled loss would make a loss), and TRL hands them on alone
                options={"sp_tiled_loss": True, "compute_metrics": token_metrics},
            ),
            # 9 eval samples: the last batch evened out by accelerate, its repeated rows in no part of the loss
            "trainer_moe_aux_dp2_sp2_gas2": lambda: ulysses_trainer(
                "trainer_moe_aux_dp2_sp2_gas2",
                2,
                model=moe_model(),
                gradient_accumulation_steps=2,
                num_train_epochs=1,
            ),
            "sft_moe_eval_dp2_sp2": lambda: sft_moe_eval("sft_moe_eval_dp2_sp2"),
            # average_tokens_across_devices=False: each dp replica's loss over its SP group's targets, as plain DDP
            "trainer_own_tokens_dp2_sp2": lambda: ulysses_trainer("trainer_own_tokens_dp2_sp2", 2, **OWN_TOKENS),
            "trainer_moe_own_tokens_dp2_sp2": lambda: ulysses_trainer(
                "trainer_moe_own_tokens_dp2_sp2", 2, model=moe_model(), **OWN_TOKENS
            ),
            "trainer_smoothed_own_tokens_dp2_sp2": lambda: ulysses_trainer(
                "trainer_smoothed_own_tokens_dp2_sp2", 2, label_smoothing_factor=0.1, **OWN_TOKENS
            ),
            "sft_moe_own_tokens_dp2_sp2": lambda: sft_moe_own_tokens("sft_moe_own_tokens_dp2_sp2", 2),
            "refusal_in_worker_dp2_sp2": refusal_in_worker_dp2_sp2,
            "split_batches_refused_dp2_sp2": split_batches_refused_dp2_sp2,
        }
    )
