"""What a decoder layer back-propagated after the last one holds that the last one does not, under FSDP2.

The planner builds its backward phases for the last decoder layer (the first to run its backward), where the
other layers' activations are all still held. Every layer after it in backward order holds what FSDP2 made of the
layers before it: the fp32 reduce-scatter input of the previous one (its unsharded gradients, kept until this
layer's own reduce-scatter begins: FSDP2 keeps one such buffer) and, unless the optimizer states live on the host,
the fp32 sharded gradients of all of them; it no longer holds those layers' activations (without checkpointing all
they saved, with it the inputs of the checkpoint groups already done and those its own group rebuilt after it);
layer 0 has no next one prefetched. From layer L-2 down to layer 1 each layer (each group of layers, with a
checkpoint stride) changes the total by the same amount, a layer's sharded gradients less what it freed, so the
highest of them is at one end: :func:`earlier_layers` gives layers L-2, 1 and 0 as changes to the last layer's
phases and :func:`add_earlier_layers` adds them. Where weights outweigh activations (short sequences, large
layers) one of them peaks higher than the last layer. Measured (``ulysses_sp.simulate.simulate_step``, FSDP2 over
2 ranks, sp=2, fp32, CPU), plan / simulate: hidden 1024, 4 layers, 512 tokens, 1.012 (0.847 from the last layer's
phases alone); hidden 512, 256 tokens, 1.012 with 4 layers (0.854) and 1.019 with 2 (0.958).
"""

from __future__ import annotations

__all__ = ["add_earlier_layers", "earlier_layers", "unsharded_layers"]


def unsharded_layers(world: int, *, next_layer: bool = True) -> int:
    """Decoder layers FSDP2 holds unsharded while one runs its backward: it and the next one, prefetched; it alone
    where no layer is left to prefetch (layer 0) or where ``world`` is one rank, whose prefetch is a no-op (the
    all-gather, a copy, is made when the layer itself runs; measured, sp=1: Mixtral, DeepSeek-V3)."""
    return 2 if next_layer and world > 1 else 1


def earlier_layers(
    *,
    layers: int,
    layer_params: int,
    world: int,
    c: int,
    offload_states: bool,
    freed: float,
    freed_in: str,
    stride: int = 1,
) -> dict[int, dict[str, float]]:
    """``{layer index: {component: bytes}}``: what layers L-2, 1 and 0 (those that exist, each once; layer 1 only
    where it differs from layer L-2) hold over the last layer's backward phases; ``freed``: the bytes of ``freed_in``
    one layer releases once its backward is done (without checkpointing) or one layer input (with it, in groups of
    ``stride`` layers: a group's head input is freed once the group is done, and the inputs rebuilt from it, which
    the last layer's phases count whole, one by one); 0 where they live on the host; ``c``: bytes of the dtype FSDP2
    gathers weights in."""
    reduce_input = 4 * layer_params  # fp32 (reduce_dtype) unsharded gradients, padded shards aside
    shard = 0 if offload_states else 4 * layer_params / world
    groups = -(-layers // stride)
    found: dict[int, dict[str, float]] = {}
    for layer in dict.fromkeys((layers - 2, 1, 0)):  # L-2 first: layer 1 is added only where it differs
        if not 0 <= layer < layers - 1:
            continue
        done = layers - 1 - layer  # layers back-propagated before this one
        change = {
            "gradients": reduce_input + done * shard,
            # the heads of the groups wholly after this layer, and the inputs its own group rebuilt after it
            freed_in: -freed * (groups - (layer // stride + 1) + stride - 1 - layer % stride),
            "weights": (unsharded_layers(world, next_layer=layer > 0) - unsharded_layers(world)) * c * layer_params,
        }
        if layer == 0 or change not in found.values():
            found[layer] = change
    return found


def _shifted(phase: dict[str, float], change: dict[str, float]) -> dict[str, float]:
    """A phase's components with ``change`` added (components it lacks start at 0)."""
    return {**phase, **{k: phase.get(k, 0) + v for k, v in change.items()}}


def add_earlier_layers(phases: dict[str, dict[str, float]], *, mode: str, stride: int, **sizes: float) -> None:
    """Add to ``phases`` (in place) each of the last layer's phases again for the layers of :func:`earlier_layers`,
    named by index (``"backward: layer 0's attention"``); ``sizes``: its sizes but ``freed_in`` and ``stride``,
    which follow from the checkpointing ``mode`` (without it a layer frees all it saved; with it a group of
    ``stride`` layers frees its input)."""
    none = mode == "none"
    later = earlier_layers(
        **sizes, freed_in="layer_activations" if none else "checkpoints", stride=1 if none else stride
    )
    last = [name for name in phases if "last layer's" in name]
    for layer, change in later.items():
        for name in last:
            phases[name.replace("last layer's", f"layer {layer}'s")] = _shifted(phases[name], change)
