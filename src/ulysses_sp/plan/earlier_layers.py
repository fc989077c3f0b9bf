"""What a decoder layer back-propagated after the last one holds that the last one does not, under FSDP2.

The planner builds its backward phases for the last decoder layer (the first to run its backward), where the
other layers' activations are all still held. Every layer after it in backward order holds what FSDP2 made of the
layers before it: the fp32 reduce-scatter input of the previous one (its unsharded gradients, kept until this
layer's own reduce-scatter begins) and, unless the optimizer states live on the host, the fp32 sharded gradients
of all of them; it no longer holds those layers' activations; the first layer has no next one prefetched. Where
weights outweigh activations (short sequences, large layers) one of these layers peaks higher than the last:
:func:`earlier_layers` gives the two candidates (the second layer in backward order, the first layer), as changes
to the last layer's phases, and :func:`shifted` applies one. Measured (``ulysses_sp.simulate.simulate_step``,
FSDP2 over 2 ranks, sp=2, fp32, CPU): hidden 1024, 4 layers, 512 tokens, plan / simulate 0.847 from the last
layer's phases alone, 0.972 with these; hidden 512, 256 tokens: 0.854 -> 0.973 (4 layers), 0.958 -> 1.019 (2).
"""

from __future__ import annotations

__all__ = ["add_earlier_layers", "earlier_layers", "shifted"]


def earlier_layers(
    *,
    layers: int,
    layer_params: int,
    world: int,
    c: int,
    offload_states: bool,
    freed: float,
    freed_in: str,
    kept: int,
) -> dict[str, dict[str, float]]:
    """``{layer name: {component: bytes}}``: what the second layer in backward order (``"second-to-last"``, where
    there are more than two) and the first layer (``"first"``) hold over the last layer's backward phases; ``freed``:
    the bytes of ``freed_in`` one layer releases once its backward is done (0 where they live on the host), ``kept``:
    the layers whose inputs are kept (a checkpoint stride of k keeps one layer in k); ``c``: bytes of the dtype FSDP2
    gathers weights in."""
    if layers < 2:
        return {}
    reduce_input = 4 * layer_params  # fp32 (reduce_dtype) unsharded gradients, padded shards aside
    shard = 0 if offload_states else 4 * layer_params / world
    found = {
        "first": {
            "gradients": reduce_input + (layers - 1) * shard,
            freed_in: -freed * (kept - 1),
            "weights": -c * layer_params,  # no next layer to prefetch
        }
    }
    if layers > 2:
        found["second-to-last"] = {"gradients": reduce_input + shard, freed_in: -freed if kept == layers else 0}
    return found


def shifted(phase: dict[str, float], change: dict[str, float]) -> dict[str, float]:
    """A phase's components with ``change`` added (components it lacks start at 0)."""
    return {**phase, **{k: phase.get(k, 0) + v for k, v in change.items()}}


def add_earlier_layers(phases: dict[str, dict[str, float]], *, mode: str, kept: int, **sizes: float) -> None:
    """Add to ``phases`` (in place) each of the last layer's phases again for the layers of :func:`earlier_layers`
    (``sizes``: its sizes but ``freed_in`` and ``kept``, which follow from the checkpointing ``mode``: without it a
    layer frees all it saved, every layer's; with it the inputs of ``kept`` layers)."""
    none = mode == "none"
    later = earlier_layers(
        **sizes, freed_in="layer_activations" if none else "checkpoints", kept=sizes["layers"] if none else kept
    )
    for name, change in later.items():
        for phase in [p for p in phases if "last layer's" in p]:
            phases[phase.replace("last layer's", f"{name} layer's")] = shifted(phases[phase], change)
