"""The parallel layout: world = dp x sp on torch.distributed, as one explicit, validated object.

Ranks are laid out as a ``[dp, sp]`` grid in row-major order, so every sequence-parallel (SP) group is a
contiguous block of ``sp`` ranks (on one node when ``sp`` divides the GPUs per node, which keeps the
all-to-alls on NVLink) and the data-parallel (DP) group of a rank holds the ranks with the same position
inside their SP block. A third group, ``loss_group``, spans the whole world: token counts and the loss are
reduced over it. A ring axis (Ulysses x Ring) will become one more mesh dimension between ``dp`` and ``sp``.

No group lives in module state: pass the layout to whoever needs a group. ``ParallelLayout.single()``
describes one process with no process group at all; it is the reference every parallel run is compared to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelLayout", "check_heads_split", "sp_degrees_for"]

ProcessGroup = dist.ProcessGroup


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sp_degrees_for(num_heads: int, num_kv_heads: int | None = None) -> list[int]:
    """The sp values that work for a model with these head counts (see :func:`check_heads_split`)."""
    kv = num_kv_heads or num_heads
    return [p for p in _divisors(num_heads) if (kv % p == 0 or p % kv == 0)]


def check_heads_split(num_heads: int, num_kv_heads: int | None, sp: int) -> None:
    """Raise ValueError unless the heads split over ``sp`` ranks.

    Query heads must be divisible by sp. Key/value heads must be divisible by sp, or (GQA/MQA with
    fewer kv heads than ranks) sp must be divisible by the kv head count. Needs no process group, so a
    launcher can check a model against ``--sp`` before starting any rank.
    """
    kv = num_kv_heads or num_heads
    if num_heads % sp == 0 and (kv % sp == 0 or sp % kv == 0):
        return
    good = ", ".join(str(p) for p in sp_degrees_for(num_heads, kv))
    raise ValueError(
        f"the model has num_attention_heads={num_heads} and num_key_value_heads={kv}, which do not split "
        f"over sp={sp} ranks (query heads must be divisible by sp; kv heads divisible by sp, or sp "
        f"divisible by kv heads); sp values that work: {good}"
    )


@dataclass(frozen=True, eq=False)
class ParallelLayout:
    """Where this rank sits in a ``dp x sp`` grid, and the process groups along each axis.

    Build it with :meth:`from_env` (torchrun / accelerate / Slurm environment), :meth:`from_groups` (groups
    you made yourself) or :meth:`single` (one process, no process group). Fields are read-only.

    Attributes:
        dp: number of data-parallel replicas (SP groups).
        sp: Ulysses degree: ranks that split one sequence.
        rank: this rank in the world (0 in a single process).
        sp_rank: this rank's index inside its SP group; its shard is tokens
            ``[sp_rank * N / sp, (sp_rank + 1) * N / sp)`` of every row.
        dp_rank: index of this rank's SP group; SP groups see different samples.
        sp_group / dp_group / loss_group: process groups (None when that axis has one rank and no
            process group exists). ``loss_group`` spans dp x sp.
        device: the device activations live on (cuda:LOCAL_RANK on GPU, cpu otherwise).
        mesh: the ``DeviceMesh`` with dims ``("dp", "sp")`` when built by :meth:`from_env`.
    """

    dp: int
    sp: int
    rank: int = 0
    sp_rank: int = 0
    dp_rank: int = 0
    sp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    loss_group: ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.sp_rank < self.sp or not 0 <= self.dp_rank < self.dp:
            raise ValueError(
                f"rank coordinates out of range: sp_rank={self.sp_rank} (sp={self.sp}), "
                f"dp_rank={self.dp_rank} (dp={self.dp})"
            )
        if self.sp > 1 and self.sp_group is None:
            raise ValueError(f"sp={self.sp} needs an sp_group; build the layout with ParallelLayout.from_env")
        if self.sp_group is not None and dist.get_world_size(self.sp_group) != self.sp:
            raise ValueError(f"sp_group has {dist.get_world_size(self.sp_group)} ranks but sp={self.sp}")
        if self.dp_group is not None and dist.get_world_size(self.dp_group) != self.dp:
            raise ValueError(f"dp_group has {dist.get_world_size(self.dp_group)} ranks but dp={self.dp}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def single(cls, device: torch.device | str | None = None) -> ParallelLayout:
        """One process, sp=1, dp=1, no process group: the reference layout."""
        return cls(dp=1, sp=1, device=torch.device(device) if device is not None else torch.device("cpu"))

    @classmethod
    def from_env(
        cls, sp: int, *, backend: str | None = None, device: torch.device | str | None = None
    ) -> ParallelLayout:
        """Build the layout for this process from the launcher's environment (RANK, WORLD_SIZE, ...).

        Initialises the default process group when it is not initialised yet (``nccl`` when CUDA is
        available, else ``gloo``). With no launcher environment and ``sp == 1`` it returns
        :meth:`single`. ``dp`` is ``world_size // sp``.
        """
        if not isinstance(sp, int) or sp < 1:
            raise ValueError(f"sp must be a positive int, got {sp!r}")
        launched = dist.is_initialized() or "WORLD_SIZE" in os.environ
        if not launched:
            if sp == 1:
                return cls.single(device)
            raise ValueError(
                f"sp={sp} needs {sp} processes, but no process group is initialised and WORLD_SIZE is unset; "
                f"start with `torchrun --nproc-per-node {sp} ...` (or `ulysses-sp train`, which launches its ranks)"
            )
        if not dist.is_initialized():
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        world = dist.get_world_size()
        if world % sp != 0:
            good = ", ".join(str(d) for d in _divisors(world))
            raise ValueError(f"world size {world} is not divisible by sp={sp}; sp values that work: {good}")
        if device is None:
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        device = torch.device(device)
        mesh = init_device_mesh(device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
        rank = dist.get_rank()
        return cls(
            dp=world // sp,
            sp=sp,
            rank=rank,
            sp_rank=rank % sp,
            dp_rank=rank // sp,
            sp_group=mesh.get_group("sp"),
            dp_group=mesh.get_group("dp"),
            loss_group=dist.group.WORLD,
            device=device,
            mesh=mesh,
        )

    @classmethod
    def from_groups(
        cls,
        sp_group: ProcessGroup | None,
        dp_group: ProcessGroup | None = None,
        *,
        loss_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> ParallelLayout:
        """Wrap process groups made elsewhere (e.g. by Accelerate or your own ``new_group`` calls).

        ``loss_group`` defaults to the world group. The SP group of every rank must be a contiguous block
        of ranks in the same order as the sequence shards: shard ``i`` lives on the group's rank ``i``.
        """
        sp = dist.get_world_size(sp_group) if sp_group is not None else 1
        dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        if loss_group is None and dist.is_initialized():
            loss_group = dist.group.WORLD
        world = dist.get_world_size(loss_group) if loss_group is not None else 1
        if world != dp * sp:
            raise ValueError(f"loss group has {world} ranks, but dp x sp = {dp} x {sp} = {dp * sp}")
        return cls(
            dp=dp,
            sp=sp,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            sp_rank=dist.get_rank(sp_group) if sp_group is not None else 0,
            dp_rank=dist.get_rank(dp_group) if dp_group is not None else 0,
            sp_group=sp_group,
            dp_group=dp_group,
            loss_group=loss_group,
            device=torch.device(device) if device is not None else torch.device("cpu"),
        )

    # ------------------------------------------------------------------ derived facts
    @property
    def world_size(self) -> int:
        """dp x sp."""
        return self.dp * self.sp

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that prints and writes files)."""
        return self.rank == 0

    def sp_degrees_for(self, num_heads: int, num_kv_heads: int | None = None) -> list[int]:
        """The sp values that work for a model with these head counts (see :meth:`check_heads`)."""
        return sp_degrees_for(num_heads, num_kv_heads)

    def check_heads(self, num_heads: int, num_kv_heads: int | None = None) -> None:
        """Raise ValueError unless the heads split over ``sp`` ranks (see :func:`check_heads_split`)."""
        check_heads_split(num_heads, num_kv_heads, self.sp)

    def __repr__(self) -> str:
        return (
            f"ParallelLayout(dp={self.dp}, sp={self.sp}, rank={self.rank}, dp_rank={self.dp_rank}, "
            f"sp_rank={self.sp_rank}, device={self.device})"
        )
