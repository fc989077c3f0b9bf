"""The parallel layout: world = dp x sp on torch.distributed, as one explicit, validated object.

Ranks are laid out as a ``[dp, sp]`` grid in row-major order, so every sequence-parallel (SP) group is a
contiguous block of ``sp`` ranks (on one node when ``sp`` divides the GPUs per node, which keeps the
all-to-alls on NVLink) and the data-parallel (DP) group of a rank holds the ranks with the same position
inside their SP block. A third group, ``loss_group``, spans the whole world: token counts and the loss are
reduced over it.

Hybrid Ulysses x Ring: ``sp = ulysses x ring``. Ulysses needs the query heads divisible by its degree, so
past the head count (or where the kv heads do not split) the rest of ``sp`` becomes a ring axis. The mesh
is then ``("dp", "ring", "ulysses")``, the Ulysses axis innermost (its all-to-alls are the heavier
exchange, so they stay on the closest ranks); ``sp_rank = ring_rank * ulysses + ulysses_rank``, and
``sp_group`` / ``sp_rank`` / ``sp`` still mean "the ranks that split one sequence", so sharding and the
loss do not care whether a ring is present. :func:`choose_layout` picks ``ulysses x ring`` from the head
counts and the node size: the largest Ulysses degree the heads allow whose groups stay inside one node, the
ring across nodes (pure Ulysses whenever it works).

No group lives in module state: pass the layout to whoever needs a group. ``ParallelLayout.single()``
describes one process with no process group at all; it is the reference every parallel run is compared to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ulysses_sp.layout_choice import (
    check_heads_split,
    choose_layout,
    choose_ring_degree,
    describe_layouts,
    divisors,
    hybrid_layouts_for,
    resolve_ring_degree,
    ring_choices,
    sp_degrees_for,
)
from ulysses_sp.process_group import agree_on_layout, init_default_group

__all__ = [
    "ParallelLayout",
    "check_heads_split",
    "choose_layout",
    "choose_ring_degree",
    "divisors",
    "hybrid_layouts_for",
    "resolve_ring_degree",
    "sp_degrees_for",
]

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True, eq=False)
class ParallelLayout:
    """Where this rank sits in a ``dp x sp`` grid, and the process groups along each axis.

    Build it with :meth:`from_env` (torchrun / accelerate / Slurm environment), :meth:`from_groups` (groups
    you made yourself) or :meth:`single` (one process, no process group). Fields are read-only.

    Attributes:
        dp: number of data-parallel replicas (SP groups).
        sp: ranks that split one sequence (``ulysses x ring``).
        rank: this rank in the world (0 in a single process).
        sp_rank: this rank's index inside its SP group; its shard is tokens
            ``[sp_rank * N / sp, (sp_rank + 1) * N / sp)`` of every row (of the zigzag order when
            ``ring > 1``, see :func:`ulysses_sp.ring.zigzag_order`).
        dp_rank: index of this rank's SP group; SP groups see different samples.
        sp_group / dp_group / loss_group: process groups (None when that axis has one rank and no
            process group exists). ``loss_group`` spans dp x sp.
        device: the device activations live on (cuda:LOCAL_RANK on GPU, cpu otherwise).
        mesh: the ``DeviceMesh`` built by :meth:`from_env`: dims ``("dp", "sp")``, or
            ``("dp", "ring", "ulysses")`` when ``ring > 1``.
        ring: ring degree (1: pure Ulysses); ``ulysses = sp // ring``.
        ring_group: the ``ring`` ranks with this rank's Ulysses rank in the other Ulysses groups of its
            SP group (None when ``ring == 1``); its group rank is :attr:`ring_rank`.
        ulysses_group: the ``ulysses`` consecutive ranks of the SP group that exchange heads (the SP
            group itself when ``ring == 1``; None when ``ulysses == 1``).
        is_view: True for :meth:`rank_view`: one rank's coordinates without process groups.
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
    ring: int = 1
    ring_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None
    is_view: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "sp", "ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.sp % self.ring:
            raise ValueError(f"ring={self.ring} does not divide sp={self.sp}; {ring_choices(self.sp)}")
        if not 0 <= self.sp_rank < self.sp or not 0 <= self.dp_rank < self.dp:
            raise ValueError(
                f"rank coordinates out of range: sp_rank={self.sp_rank} (sp={self.sp}), "
                f"dp_rank={self.dp_rank} (dp={self.dp})"
            )
        if self.is_view:  # coordinates only (see rank_view): no group to check
            return
        if self.sp > 1 and self.sp_group is None:
            raise ValueError(f"sp={self.sp} needs an sp_group; build the layout with ParallelLayout.from_env")
        if self.dp > 1 and (self.dp_group is None or self.loss_group is None):  # replicas_agree, sp=1 too
            raise ValueError(f"dp={self.dp} needs a dp_group and a loss_group; build the layout with from_env")
        for axis, size, group in (("sp", self.sp, self.sp_group), ("dp", self.dp, self.dp_group)):
            if group is not None and dist.get_world_size(group) != size:
                raise ValueError(f"{axis}_group has {dist.get_world_size(group)} ranks but {axis}={size}")
        if self.ring == 1 and self.ulysses_group is None:
            object.__setattr__(self, "ulysses_group", self.sp_group)
        for name, size in (("ring_group", self.ring), ("ulysses_group", self.ulysses)):
            group = getattr(self, name)
            if size > 1 and group is None:
                raise ValueError(f"{name} is missing for {name.split('_')[0]} degree {size}")
            if group is not None and dist.get_world_size(group) != size:
                raise ValueError(f"{name} has {dist.get_world_size(group)} ranks but {name[:-6]} degree is {size}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def single(cls, device: torch.device | str | None = None) -> ParallelLayout:
        """One process, sp=1, dp=1, no process group: the reference layout."""
        return cls(dp=1, sp=1, device=torch.device(device) if device is not None else torch.device("cpu"))

    @classmethod
    def rank_view(
        cls,
        sp: int,
        sp_rank: int,
        *,
        dp: int = 1,
        dp_rank: int = 0,
        ring: int = 1,
        device: torch.device | str | None = None,
    ) -> ParallelLayout:
        """Where rank ``sp_rank`` of an SP group of ``sp`` ranks sits, with no process group: enough for
        :func:`ulysses_sp.shard_batch` to cut any rank's shard in one process (``check_same_batch`` needs a
        group, so it is skipped), not for training (:func:`ulysses_sp.parallelize` refuses a view)."""
        return cls(
            dp=dp,
            sp=sp,
            rank=dp_rank * sp + sp_rank,
            sp_rank=sp_rank,
            dp_rank=dp_rank,
            device=torch.device(device) if device is not None else torch.device("cpu"),
            ring=ring,
            is_view=True,
        )

    @classmethod
    def from_env(
        cls,
        sp: int,
        *,
        ring: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        gpus_per_node: int | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> ParallelLayout:
        """Build the layout for this process from the launcher's environment (RANK, WORLD_SIZE, ...).

        Initialises the default process group when it is not initialised yet (``nccl`` when CUDA is available,
        else ``gloo``). With no launcher environment and ``sp == 1`` it returns :meth:`single`. ``dp`` is
        ``world_size // sp``; every rank must ask for the same ``sp`` and ``ring`` (else a ValueError on each).

        ``ring``: the ring degree (``sp = ulysses x ring``). None (default): chosen by :func:`choose_layout`
        from ``num_heads`` / ``num_kv_heads`` and ``gpus_per_node`` (default: ``LOCAL_WORLD_SIZE``, the
        processes torchrun starts per node): the largest Ulysses degree that the heads allow and that keeps
        every Ulysses group inside one node, the ring across nodes (pure Ulysses when neither limits it).
        With the head counts given, a ring whose Ulysses degree the heads do not allow is a ValueError
        listing the ``(ulysses, ring)`` pairs that work.
        """
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
            raise ValueError(f"sp must be a positive int, got {sp!r}")
        if gpus_per_node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
            gpus_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        ring = resolve_ring_degree(sp, ring, num_heads, num_kv_heads, gpus_per_node)
        launched = dist.is_initialized() or "WORLD_SIZE" in os.environ
        if not launched:
            if sp == 1:
                return cls.single(device)
            raise ValueError(
                f"sp={sp} needs {sp} processes, but no process group is initialised and WORLD_SIZE is unset; "
                f"start with `torchrun --nproc-per-node {sp} ...` (or `ulysses-sp train`, which launches its ranks)"
            )
        init_default_group(backend)
        world = dist.get_world_size()
        agree_on_layout(sp, ring, world)
        if world % sp != 0:
            good = ", ".join(str(d) for d in divisors(world))
            raise ValueError(f"world size {world} is not divisible by sp={sp}; sp values that work: {good}")
        if device is None:
            nccl = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        device = torch.device(device)
        rank = dist.get_rank()
        if ring == 1:
            mesh = init_device_mesh(device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
            sp_group, ring_group, ulysses_group = mesh.get_group("sp"), None, mesh.get_group("sp")
        else:  # dp x ring x ulysses, Ulysses innermost; "sp" = ring x ulysses flattened (ring-major)
            dims = ("dp", "ring", "ulysses")
            mesh = init_device_mesh(device.type, (world // sp, ring, sp // ring), mesh_dim_names=dims)
            sp_group = mesh["ring", "ulysses"]._flatten("sp").get_group()
            ring_group = mesh.get_group("ring")
            ulysses_group = mesh.get_group("ulysses") if sp > ring else None
        return cls(
            dp=world // sp,
            sp=sp,
            rank=rank,
            sp_rank=rank % sp,
            dp_rank=rank // sp,
            sp_group=sp_group,
            dp_group=mesh.get_group("dp"),
            loss_group=dist.group.WORLD,
            device=device,
            mesh=mesh,
            ring=ring,
            ring_group=ring_group,
            ulysses_group=ulysses_group,
        )

    @classmethod
    def from_groups(
        cls,
        sp_group: ProcessGroup | None,
        dp_group: ProcessGroup | None = None,
        *,
        loss_group: ProcessGroup | None = None,
        ring_group: ProcessGroup | None = None,
        ulysses_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> ParallelLayout:
        """Wrap process groups made elsewhere (e.g. by Accelerate or your own ``new_group`` calls).

        ``loss_group`` defaults to the world group. The SP group of every rank must be a contiguous block
        of ranks in the same order as the sequence shards: shard ``i`` lives on the group's rank ``i``.
        For a hybrid layout also pass ``ring_group`` and (when ``ulysses > 1``) ``ulysses_group``, with
        ``sp_rank == ring_rank * ulysses + ulysses_rank``.
        """
        sp = dist.get_world_size(sp_group) if sp_group is not None else 1
        dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        ring = dist.get_world_size(ring_group) if ring_group is not None else 1
        if ring > 1 and sp % ring == 0:
            sp_rank = dist.get_rank(sp_group)
            ulysses_rank = dist.get_rank(ulysses_group) if ulysses_group is not None else 0
            if dist.get_rank(ring_group) * (sp // ring) + ulysses_rank != sp_rank:
                raise ValueError(
                    f"sp_rank {sp_rank} != ring_rank {dist.get_rank(ring_group)} x ulysses {sp // ring} + "
                    f"ulysses_rank {ulysses_rank}: the ring and Ulysses groups do not tile the SP group ring-major"
                )
        if dist.is_initialized():
            init_default_group()  # the group exists: this only adds the gloo exit settle, as from_env does
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
            ring=ring,
            ring_group=ring_group,
            ulysses_group=ulysses_group if ring > 1 else sp_group,
        )

    # ------------------------------------------------------------------ derived facts
    @property
    def world_size(self) -> int:
        """dp x sp."""
        return self.dp * self.sp

    @property
    def ulysses(self) -> int:
        """Ulysses degree: ranks that exchange heads by all-to-all (``sp // ring``)."""
        return self.sp // self.ring

    @property
    def ulysses_rank(self) -> int:
        """This rank's index in its Ulysses group."""
        return self.sp_rank % self.ulysses

    @property
    def ring_rank(self) -> int:
        """This rank's index in its ring group (0 when ``ring == 1``)."""
        return self.sp_rank // self.ulysses

    @property
    def is_main(self) -> bool:  # global rank 0: the rank that prints and writes files
        return self.rank == 0

    def check_heads(self, num_heads: int, num_kv_heads: int | None = None) -> None:
        """Raise ValueError unless the heads split over the Ulysses degree (see :func:`check_heads_split`);
        the message lists the ``(ulysses, ring)`` layouts of this ``sp`` that would work."""
        try:
            check_heads_split(num_heads, num_kv_heads, self.ulysses)
        except ValueError as err:
            pairs = describe_layouts(hybrid_layouts_for(self.sp, num_heads, num_kv_heads))
            raise ValueError(
                f"{err}. This layout is ulysses {self.ulysses} x ring {self.ring} = sp {self.sp}; the layouts "
                f"of sp={self.sp} that work for these heads: {pairs} (ParallelLayout.from_env(sp={self.sp}, "
                f"ring=...), or leave ring=None and pass num_heads/num_kv_heads to choose automatically)"
            ) from None

    def __getstate__(self) -> dict[str, object]:
        """pickle / torch.save: a rank view or a layout without process groups pickles; groups live in this process
        only, so a layout with any is a TypeError naming what to save instead (a model holds its layout while it
        is parallelized)."""
        groups = (self.sp_group, self.dp_group, self.loss_group, self.ring_group, self.ulysses_group, self.mesh)
        if any(group is not None for group in groups):
            raise TypeError(
                f"cannot pickle {self!r}: its process groups exist in this process only. To save a model that "
                "ulysses_sp.parallelize changed, save its weights (torch.save(model.state_dict(), path) or "
                "model.save_pretrained(path)) or call ulysses_sp.unparallelize(model) first; to send where a rank "
                "sits, pickle ParallelLayout.rank_view(sp, sp_rank, dp=..., dp_rank=..., ring=...)"
            )
        return dict(self.__dict__)

    def __copy__(self) -> ParallelLayout:  # the same groups (copy.copy would otherwise go through __getstate__)
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict) -> ParallelLayout:
        return self  # read-only, and process groups cannot be copied: a copy (of a model, say) shares them

    def __repr__(self) -> str:
        ring = f", ulysses={self.ulysses}, ring={self.ring}" if self.ring > 1 else ""
        return (
            f"ParallelLayout(dp={self.dp}, sp={self.sp}{ring}, rank={self.rank}, dp_rank={self.dp_rank}, "
            f"sp_rank={self.sp_rank}, device={self.device})"
        )
