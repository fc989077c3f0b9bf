"""The long-sequence memory features as one object: what a step runs with, and the one function that turns it on.

:class:`Features` names how a training step is run (tiled loss, tiled MLP, activation checkpointing or
offload, optimizer offload, FSDP2 or DDP, dtype). Its fields are also the flags of ``ulysses-sp train`` and
``ulysses-sp plan`` (both configs extend it), so the planner predicts exactly what training runs.
:func:`apply_features` switches them on a model; ``train``, ``plan --simulate``, ``bench`` and the
integrations all call it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cli_config import check_choices, option
from .tiled_loss.sizing import DEFAULT_LOSS_BUDGET_BYTES

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CHECKPOINT_MODES",
    "DTYPES",
    "PARALLEL_MODES",
    "Features",
    "apply_features",
    "bf16_error",
    "bf16_missing",
    "cli_switch",
]

CHECKPOINT_MODES = ("auto", "none", "checkpoint", "offload")
PARALLEL_MODES = ("fsdp2", "ddp")
DTYPES = ("auto", "bf16", "fp32")  # fp16 would need loss scaling


@dataclass(kw_only=True)
class Features:
    """Memory features and parallel wrapper (the same flags for ulysses-sp train and plan).

    How a step is run. ``"auto"`` values depend on the device: see :meth:`resolve`.

    Defaults are what ``ulysses-sp train`` runs: tiled loss and MLP, checkpoints offloaded to host memory on
    a GPU (kept on the device on a CPU), FSDP2, bf16 on a GPU with native bf16 (fp32 on a CPU or an older GPU).
    """

    tiled_loss: bool = option(
        True,
        help="Compute lm_head + cross-entropy in chunks of tokens, each chunk's gradients made in the forward (nothing "
        "recomputed), so the [tokens, vocab] logits are never held (--no-tiled-loss: the model's plain logits path).",
    )
    loss_chunk_mib: int = option(
        DEFAULT_LOSS_BUDGET_BYTES >> 20,
        help="With --tiled-loss: memory (MiB) for one chunk of logits; tokens per chunk follow from it.",
    )
    loss_chunk_tokens: int | None = option(
        None, help="With --tiled-loss: tokens per loss chunk, instead of --loss-chunk-mib; 'none' = from it."
    )
    tiled_mlp: bool = option(
        True,
        help="Run each MLP over chunks of tokens and recompute them in backward, so the [tokens, intermediate] "
        "activations are never held whole (--no-tiled-mlp: the plain MLP).",
    )
    mlp_chunk_tokens: int | None = option(
        None, help="With --tiled-mlp: tokens per chunk; 'none' = max(1024, hidden size)."
    )
    tiled_norms: bool = option(
        True,
        help="Run each decoder layer's norms over chunks of tokens, recomputed in backward, and fuse the norm "
        "before a tiled MLP into its chunks, so a norm keeps only its input (--no-tiled-norms: the plain norms).",
    )
    activation_checkpointing: str = option(
        "auto",
        help="Keep only each decoder layer's input and recompute the layer in backward: 'checkpoint' keeps the "
        "inputs on the device, 'offload' in (pinned) host memory, 'none' keeps every activation; "
        "'auto' = offload on GPU, checkpoint on CPU.",
        choices=CHECKPOINT_MODES,
    )
    head_chunks: int | None = option(
        None,
        help="Run each attention layer's heads in this many chunks (exchange, core and backward one or two chunks "
        "at a time, exchanges overlapped with the other chunk's compute); 'none' or 0 = automatic (chunks where "
        "one chunk's q/k/v after the exchange would exceed 1 GiB per rank), 1 = never.",
    )
    checkpoint_stride: int | None = option(
        None,
        help="With activation checkpointing: keep the input of every k-th decoder layer only and recompute the "
        "k-1 layers after it from it in backward (1 = every layer's input kept); 'none' = 1, or, where "
        "--host-memory is given on a GPU with --activation-checkpointing auto, chosen by the planner with the "
        "checkpoints' place (host or GPU) so that both memories hold.",
    )
    cpu_offload_optimizer: bool = option(
        False,
        help="FSDP2 only, on GPU: keep the sharded parameters, gradients and optimizer states in CPU memory "
        "(the optimizer steps on CPU); a no-op on a CPU-only machine.",
    )
    parallel: str = option(
        "fsdp2",
        help="Data-parallel wrapper over the whole world: 'fsdp2' (sharded) or 'ddp'.",
        choices=PARALLEL_MODES,
    )
    dtype: str = option(
        "auto",
        help="Compute dtype (bf16 = autocast, with fp32 master weights and optimizer states): "
        "'auto' = bf16 on a GPU, fp32 on a CPU or on a GPU without native bf16 (compute capability below 8.0: "
        "V100, T4).",
        choices=DTYPES,
    )

    def validate(self) -> None:
        """ValueError naming the flag of any value that is out of range."""
        check_choices(self)
        for name in ("loss_chunk_mib", "loss_chunk_tokens", "mlp_chunk_tokens", "checkpoint_stride"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value!r}")
        if self.head_chunks is not None and (
            isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int) or self.head_chunks < 0
        ):
            raise ValueError(f"--head-chunks must be >= 0 (0 / none: automatic), got {self.head_chunks!r}")
        if self.cpu_offload_optimizer and self.parallel != "fsdp2":
            raise ValueError("--cpu-offload-optimizer needs --parallel fsdp2 (DDP keeps full states on every GPU)")

    def check_flags_apply(self) -> None:
        """ValueError for a flag that the others switch off (it would be silently ignored), naming both. The CLI
        configs call it; the planner's own candidates (which turn features off) are plain ``Features``."""
        default_mib = DEFAULT_LOSS_BUDGET_BYTES >> 20
        no_loss, no_tiling = not self.tiled_loss, not (self.tiled_mlp or self.tiled_norms)
        no_checkpoints = self.activation_checkpointing == "none"
        for given, flag, off, switch in (  # (the flag is set, the flag, it is switched off, by what)
            (self.loss_chunk_tokens is not None, "--loss-chunk-tokens", no_loss, "--no-tiled-loss"),
            (self.loss_chunk_mib != default_mib, "--loss-chunk-mib", no_loss, "--no-tiled-loss"),
            (self.mlp_chunk_tokens is not None, "--mlp-chunk-tokens", no_tiling, "--no-tiled-mlp and --no-tiled-norms"),
            (
                (self.checkpoint_stride or 1) > 1,
                "--checkpoint-stride",
                no_checkpoints,
                "--activation-checkpointing none",
            ),
        ):
            if given and off:
                value = getattr(self, flag[2:].replace("-", "_"))
                raise ValueError(f"{flag} {value} has no effect with {switch}: drop one of them")
        if self.loss_chunk_tokens is not None and self.loss_chunk_mib != default_mib:
            raise ValueError(
                f"--loss-chunk-tokens {self.loss_chunk_tokens} and --loss-chunk-mib {self.loss_chunk_mib} both size "
                "the loss chunk: give one of them"
            )

    def __post_init__(self) -> None:
        if type(self) is Features:  # configs that extend it validate as a whole (their validate() calls ours)
            self.validate()

    # ---------------------------------------------------------------------------------------------- presets
    @classmethod
    def baseline(cls, **overrides: Any) -> Features:
        """Before the long-sequence features: plain loss and MLP, checkpoints on the GPU, optimizer on CPU."""
        values = {
            "tiled_loss": False,
            "tiled_mlp": False,
            "tiled_norms": False,
            "activation_checkpointing": "checkpoint",
        }
        return cls(**{**values, "cpu_offload_optimizer": True, **overrides})

    @classmethod
    def all_on(cls, **overrides: Any) -> Features:
        """Every feature on: tiled loss and MLP, checkpoints offloaded to the host, optimizer on CPU."""
        values = {
            "tiled_mlp": True,
            "tiled_norms": True,
            "activation_checkpointing": "offload",
            "cpu_offload_optimizer": True,
        }
        return cls(**{**values, **overrides})

    # ---------------------------------------------------------------------------------------------- derived
    def features(self) -> Features:
        """Only the feature fields (of a config that extends :class:`Features`), as a plain ``Features``."""
        return Features(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Features)})

    def resolve(self, device: str | torch.device) -> Features:
        """``"auto"`` made concrete for ``device``: offload and bf16 on a GPU, checkpoint and fp32 on a CPU.

        ``device`` is a device type ("cuda", "cpu": a GPU with native bf16, as the planner assumes) or the
        ``torch.device`` the step runs on, whose GPU is read: fp32 where it has no native bf16 (:func:`bf16_missing`).
        """
        on_cpu = _device_type(device) == "cpu"
        mode = self.activation_checkpointing
        dtype = self.dtype
        if dtype == "auto":
            dtype = "fp32" if on_cpu or bf16_missing(device) else "bf16"
        return dataclasses.replace(
            self.features(),
            activation_checkpointing=("checkpoint" if on_cpu else "offload") if mode == "auto" else mode,
            checkpoint_stride=self.checkpoint_stride or 1,
            dtype=dtype,
        )

    @property
    def loss_budget_bytes(self) -> int:
        """The logits working set one loss chunk may use, in bytes."""
        return self.loss_chunk_mib << 20

    def torch_dtype(self, device: str | torch.device) -> Any:
        """The compute ``torch.dtype`` on ``device`` (see :meth:`resolve`; 'auto': bf16 on a GPU, fp32 on a CPU or
        a GPU without native bf16)."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.resolve(device).dtype]

    def check_dtype(self, device: torch.device) -> None:
        """ValueError when ``--dtype bf16`` is asked for on a GPU without native bf16 (:func:`bf16_missing`)."""
        missing = bf16_missing(device) if self.dtype == "bf16" else None
        if missing:
            raise ValueError(bf16_error(missing))

    def describe(self) -> str:
        """One line naming the features, e.g. for the planner's report."""
        return ", ".join(
            [
                "tiled loss" if self.tiled_loss else "plain loss",
                "tiled MLP" if self.tiled_mlp else "plain MLP",
                f"head chunks {self.head_chunks or 'auto'}",
                "tiled norms" if self.tiled_norms else "plain norms",
                f"activation checkpointing {self.activation_checkpointing}"
                + (
                    f" every {self.checkpoint_stride} layers"
                    if (self.checkpoint_stride or 1) > 1 and self.activation_checkpointing != "none"
                    else ""
                ),
                "optimizer on CPU" if self.cpu_offload_optimizer else "optimizer on GPU",
                self.parallel.upper(),
                self.dtype,
            ]
        )


def _device_type(device: str | torch.device) -> str:
    return device if isinstance(device, str) else device.type


def bf16_missing(device: str | torch.device) -> str | None:
    """The GPU and its compute capability, e.g. "Tesla V100-SXM2-16GB (compute capability 7.0)", when ``device`` is
    a CUDA GPU without native bf16 (capability below 8.0: V100, T4; there bf16 is emulated and sdpa's fused kernels
    refuse it); None for any other device. A device type string ("cuda") names no real GPU: None."""
    if isinstance(device, str) or device.type != "cuda":
        return None
    import torch

    if torch.version.hip:  # ROCm GPUs compute bf16 (as torch.cuda.is_bf16_supported says)
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 0):
        return None
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def bf16_error(missing: str) -> str:
    """The message refusing ``--dtype bf16`` on the GPU ``missing`` (:func:`bf16_missing`) names."""
    return (
        f"--dtype bf16: {missing} has no native bf16 (it needs compute capability 8.0 or newer: A100, L4, H100, ...); "
        "torch would emulate it, and sdpa's fused kernels refuse bf16 there, so attention would fall back to the math "
        "kernel that holds every [seq, seq] score; use --dtype fp32 (or --dtype auto, which picks fp32 on this GPU)"
    )


def _features_switch(field: str) -> str:
    return f"Features({field}={'none' if field == 'activation_checkpointing' else False!r})"


def cli_switch(field: str) -> str:
    """The ``ulysses-sp train`` / ``plan`` flag that turns the feature ``field`` off."""
    return (
        "--activation-checkpointing none" if field == "activation_checkpointing" else f"--no-{field.replace('_', '-')}"
    )


def apply_features(
    model: nn.Module, features: Features, device_type: str, switch: Callable[[str], str] = _features_switch
) -> Features:
    """Switch ``features`` on ``model`` (in place, before DDP / FSDP2 wrapping); returns them resolved for
    ``device_type``. The parallel wrapper, dtype and optimizer offload are the caller's (they wrap the model).

    All or nothing: when one feature cannot be switched on (e.g. a model whose layers have no MLP the tiling
    recognises), those switched on before it are undone and the error is raised again; a ValueError then names
    ``switch(field)``, the caller's way to turn that feature off (default: ``Features(field=False)``)."""
    from .offload import disable_activation_checkpointing, enable_activation_checkpointing
    from .tiled_loss import disable_tiled_loss, enable_tiled_loss
    from .tiled_norms import disable_tiled_norms, enable_tiled_norms
    from .tiling import disable_tiled_mlp, enable_tiled_mlp

    if not isinstance(features, Features):
        raise ValueError(f"features must be a ulysses_sp.Features, got {type(features).__name__}")
    _check_head_chunks(model, features.head_chunks)
    resolved = features.resolve(device_type)
    steps = [  # (on, field that turns it off, switch on, undo); the norms after the MLPs: fused into their chunks
        (
            resolved.tiled_loss,
            "tiled_loss",
            lambda: enable_tiled_loss(
                model, chunk_tokens=resolved.loss_chunk_tokens, budget_bytes=resolved.loss_budget_bytes
            ),
            disable_tiled_loss,
        ),
        (
            resolved.tiled_mlp,
            "tiled_mlp",
            lambda: enable_tiled_mlp(model, chunk_tokens=resolved.mlp_chunk_tokens),
            disable_tiled_mlp,
        ),
        (
            resolved.tiled_norms,
            "tiled_norms",
            lambda: enable_tiled_norms(model, chunk_tokens=resolved.mlp_chunk_tokens),
            disable_tiled_norms,
        ),
        (
            resolved.activation_checkpointing != "none",
            "activation_checkpointing",
            lambda: enable_activation_checkpointing(
                model, resolved.activation_checkpointing, stride=resolved.checkpoint_stride
            ),
            disable_activation_checkpointing,
        ),
    ]
    done: list = []
    for on, field, switch_on, undo in steps:
        if not on:
            continue
        try:
            switch_on()
        except Exception as error:
            for earlier in reversed(done):
                with contextlib.suppress(Exception):  # undo the rest even if one cannot be undone
                    earlier(model)
            if not isinstance(error, ValueError):
                raise
            raise ValueError(
                f"{error} [apply_features left the model as it was; {switch(field)} turns this one off]"
            ) from error
        done.append(undo)
    return resolved


def _check_head_chunks(model: nn.Module, wanted: int | None) -> None:
    """ValueError unless ``Features.head_chunks`` (``wanted``; None: no say) agrees with what the model was
    parallelized with: it is :func:`ulysses_sp.parallelize`'s setting, which ``apply_features`` cannot change."""
    from .model import ulysses_context

    if wanted is None:
        return
    try:
        given = ulysses_context(model).head_chunks  # None: automatic
    except (ValueError, TypeError):  # not parallelized (or no transformers model): nothing runs in head chunks
        if wanted > 1:
            raise _head_chunks_error(wanted, "not parallelized") from None
        return
    if (wanted or None) != given:
        raise _head_chunks_error(wanted, f"parallelized with head_chunks={given}")


def _head_chunks_error(wanted: int, state: str) -> ValueError:
    return ValueError(
        f"Features(head_chunks={wanted}) is parallelize's setting, which apply_features does not change, and this "
        f"model was {state}; pass it to ulysses_sp.parallelize(model, layout, head_chunks={wanted}) (or leave "
        "Features.head_chunks None)"
    )
