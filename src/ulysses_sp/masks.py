"""What a model's own attention mask does, so that Ulysses applies the same one without building it.

Ulysses never materialises an ``N x N`` mask: causality, sliding windows, padding and packed documents are
applied by the core from :class:`~ulysses_sp.cores.Segments`. What the model's mask WOULD contain is read from
the model itself, never from config keys alone:

* per layer, at run time: :func:`ulysses_mask` is the mask function registered with transformers. It returns
  None for a causal mask and a :class:`SlidingWindowMask` for a sliding-window one, and the model hands each
  layer the mask it built for it (:func:`mask_window` reads it; any other mask is one the model made itself,
  which Ulysses cannot apply: refused).
* per model, once, from the code of its decoder's ``forward`` (:func:`read_decoder_masks`): whether position_ids
  reach its mask builders (if not, one process lets packed documents attend to each other, and so does
  Ulysses), and whether it derives missing position_ids from the attention mask (OPT: left padding shifts them).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import masking_utils

__all__ = [
    "DecoderMasks",
    "SlidingWindowMask",
    "ids_positions_problem",
    "left_padding_problem",
    "mask_window",
    "read_decoder_masks",
    "ulysses_mask",
]


class SlidingWindowMask:
    """What :func:`ulysses_mask` returns in place of a sliding-window mask: the window alone, no tensor.

    A model that computes with it (reads an attribute, indexes it) gets a ValueError: under Ulysses there is
    no dense mask to compute with.
    """

    __slots__ = ("window",)

    def __init__(self, window: int) -> None:
        self.window = window

    def __repr__(self) -> str:
        return f"SlidingWindowMask({self.window})"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _computes_with_mask(f"reads attention_mask.{name}")

    def __getitem__(self, key: object):
        raise _computes_with_mask("indexes the attention mask")


def _computes_with_mask(what: str) -> ValueError:
    return ValueError(
        f"the model {what}, but under Ulysses no dense attention mask exists (each layer's window is applied by "
        "the Ulysses core, documents come from position_ids); a model that computes with its mask cannot be "
        "parallelized"
    )


def mask_window(module: torch.nn.Module, mask: object) -> int | None:
    """The window of the mask the model handed ``module``'s attention (None: causal); ValueError for a mask the
    model made itself (only a None test when the layer's mask is causal)."""
    if mask is None:
        return None
    if type(mask) is SlidingWindowMask:
        return mask.window
    described = f"a {type(mask).__name__} of shape {tuple(mask.shape)}" if hasattr(mask, "shape") else repr(mask)
    raise ValueError(
        f"{type(module).__name__} passes its own attention mask to the attention function ({described}) instead "
        "of the one transformers builds for Ulysses (None or a sliding window): Ulysses cannot apply a mask with "
        "content (e.g. Doge's dynamic mask, built from learned parameters), so the loss would be wrong and those "
        "parameters would get no gradient; this model cannot be parallelized"
    )


def ulysses_mask(*args, local_size: int | None = None, config=None, use_vmap: bool = False, **kwargs):
    """Registered with transformers' ``AttentionMaskInterface``: Ulysses needs no dense mask.

    Padding and documents are read once per forward pass from the 2-D mask and position_ids
    (:meth:`~ulysses_sp.attention.UlyssesAttention.begin_forward`). A causal mask is None; a sliding-window one
    (transformers passes its window as ``local_size``) is a :class:`SlidingWindowMask`. Mask functions added on
    top (``or_mask_function`` / ``and_mask_function``, which transformers marks with ``use_vmap``) are refused.
    """
    if use_vmap:
        raise ValueError(
            "the model builds its attention mask with an extra mask function (or_mask_function / and_mask_function, "
            "e.g. bidirectional attention over image tokens), which Ulysses cannot apply; this input cannot be "
            "parallelized"
        )
    if local_size is None or local_size == getattr(config, "attention_chunk_size", None):  # chunked: refused earlier
        return None
    return SlidingWindowMask(int(local_size))


# ------------------------------------------------------------------------------------------ reading the code
@dataclass(frozen=True)
class DecoderMasks:
    """What the decoder's ``forward`` does with position_ids and the attention mask (read by
    :func:`read_decoder_masks`).

    ``documents``: True when position_ids reach every mask builder it calls (transformers then keeps packed
    documents apart, as Ulysses does), False when some builder gets none (one process lets packed documents
    attend to each other), None when it calls no builder Ulysses can see (unknown). ``positions_from_mask``:
    position_ids it is not given are derived from ``attention_mask`` (OPT: ``cumsum(mask) - 1``).
    ``empty_rows_average``: the model's own attention is eager, which gives a query that sees no key (a left pad)
    the mean of every value in its row (a softmax over equally masked scores), where sdpa, flash attention and
    every Ulysses core give it zero.
    """

    documents: bool | None = True
    positions_from_mask: bool = False
    decoder: str = "the model"  # its class name, for messages
    empty_rows_average: bool = False
    # ``[b, N]`` input_ids -> the positions a module of the model gives tokens from their ids when it is given no
    # position_ids (RoBERTa's embeddings: ``padding_idx + 1 + `` the count of non-pad tokens so far), and its name
    positions_from_ids: Callable[[torch.Tensor], torch.Tensor] | None = None
    ids_numbering: str = ""


def left_padding_problem(
    positions: torch.Tensor | None, attention_mask: torch.Tensor | None, masks: DecoderMasks
) -> str | None:
    """What is wrong with left padding in the full rows (positions, attention_mask ``[b, N]``), or None.

    The last left pad carries the first token's target, so what the model gives it counts: under eager attention
    (``masks.empty_rows_average``) that is the mean of every value in the row, which no Ulysses core gives; for a
    decoder that derives position_ids from the attention mask (``cumsum(mask) * mask - 1``) its position counts
    too, so a left-padded row must hold those positions up to its last token (None: the model makes its own).
    Right padding carries no target.
    """
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.long)
    left = (mask[:, 0] == 0) & (mask.sum(dim=1) > 0)  # [b]: rows that start with padding
    if not bool(left.any()):
        return None
    if masks.empty_rows_average:
        row = int(torch.nonzero(left).flatten()[0])
        return (
            f"row {row} starts with padding, and {masks.decoder} runs eager attention, which gives a query that sees "
            "no key (a left pad) the mean of every value in its row, later tokens included; transformers' loss "
            "counts the last pad's prediction of the first token, and Ulysses gives padding zero output (as sdpa "
            "and flash attention do), so the losses would differ; pad on the right (tokenizer.padding_side = "
            "'right'), or load the model with attn_implementation='sdpa'"
        )
    if positions is None or not masks.positions_from_mask:
        return None
    index = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * index).amax(dim=1, keepdim=True)  # [b, 1]: each row's last token
    region = (index[None] <= last) & left[:, None]  # [b, N]
    derived = mask.cumsum(dim=1) * mask - 1  # [b, N]: the model's own positions (-1 on padding)
    if torch.equal(positions.to(derived.device)[region], derived[region]):
        return None
    row = int(torch.nonzero(left).flatten()[0])
    return (
        f"{masks.decoder} derives position ids from the attention mask (attention_mask.cumsum(-1) * attention_mask "
        f"- 1, so left padding shifts them), but left-padded row {row} has other positions (shard_batch numbers "
        "the tokens from the first one, padding included); pad on the right, or pass shard_batch "
        "position_ids=attention_mask.cumsum(-1) * attention_mask - 1, the model's own"
    )


def ids_positions_problem(
    positions: torch.Tensor, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, masks: DecoderMasks
) -> str | None:
    """What is wrong with the positions of the full rows (positions, input_ids, attention_mask ``[b, N]``) of a
    model that numbers tokens from their ids (``masks.positions_from_ids``), or None. One process gives them those
    numbers; a row must hold them up to its last real token (trailing padding carries no target)."""
    if masks.positions_from_ids is None or input_ids is None:
        return None
    derived = masks.positions_from_ids(input_ids).to(positions.device)  # [b, N]: the model's own positions
    index = torch.arange(positions.shape[1], device=positions.device)
    if attention_mask is None:
        region = torch.ones_like(derived, dtype=torch.bool)
    else:
        mask = attention_mask.to(device=positions.device, dtype=torch.long)
        region = index[None] <= (mask * index).amax(dim=1, keepdim=True)  # [b, N]: up to each row's last token
    differs = (positions.to(torch.long) != derived) & region  # [b, N]
    if not bool(differs.any()):
        return None
    row, token = (int(i) for i in torch.nonzero(differs)[0])
    return (
        f"{masks.ids_numbering} numbers the tokens from their ids when it is given no position_ids "
        f"(create_position_ids_from_input_ids: padding_idx + 1 + the count of non-pad tokens so far), so one process "
        f"gives row {row} token {token} position {int(derived[row, token])}, but the position_ids given hold "
        f"{int(positions[row, token])} there (shard_batch numbers the tokens 0, 1, ... unless told otherwise); pass "
        "shard_batch position_ids=<the model's embeddings>.create_position_ids_from_input_ids(input_ids, "
        "padding_idx), the model's own"
    )


def _ids_numbering(decoder: torch.nn.Module) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """The module of ``decoder`` that numbers tokens from their ids when given no position_ids (RoBERTa's
    embeddings call ``create_position_ids_from_input_ids(input_ids, padding_idx)``), and that numbering."""
    for module in decoder.modules():
        number, pad = getattr(module, "create_position_ids_from_input_ids", None), getattr(module, "padding_idx", None)
        if not callable(number) or not isinstance(pad, int):
            continue
        try:
            calls = "create_position_ids_from_input_ids" in inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            calls = True  # unreadable: assume it does
        if calls:
            return type(module).__name__, functools.partial(number, padding_idx=pad)
    return None


_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
# (name, index of position_ids among its positional parameters) of transformers' mask builders
_POSITION_ARG = {
    name: list(inspect.signature(getattr(masking_utils, name)).parameters).index("position_ids")
    for name in (*_BUILDERS, "create_masks_for_generate")
}
_METADATA = ("shape", "device", "dtype", "ndim")  # x.shape etc. carry no values of x


def _names(node: ast.AST) -> set[str]:
    """Names whose VALUES ``node`` reads (``x.shape``, ``x.device``, ``x.size()`` do not count)."""
    if isinstance(node, ast.Attribute) and node.attr in _METADATA:
        return set()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size":
        return set()
    found = {node.id} if isinstance(node, ast.Name) else set()
    for child in ast.iter_child_nodes(node):
        found |= _names(child)
    return found


def _assignments(tree: ast.AST) -> list[tuple[list[ast.expr], ast.expr]]:
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs.append((node.targets, node.value))
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            pairs.append(([node.target], node.value))
    return pairs


def _dict_keys(tree: ast.AST, pairs) -> dict[str, set[str]]:
    """name -> the string keys a dict held in that name may have (literals, copies, ``d[key] = ...``)."""
    keys: dict[str, set[str]] = {}
    parents: dict[str, set[str]] = {}
    for targets, value in pairs:
        for target in targets:
            literal = isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
            if literal and isinstance(target.value, ast.Name) and isinstance(target.slice.value, str):
                keys.setdefault(target.value.id, set()).add(target.slice.value)
            if not isinstance(target, ast.Name):
                continue
            name = target.id
            if isinstance(value, ast.Dict):
                keys.setdefault(name, set()).update(k.value for k in value.keys if isinstance(k, ast.Constant))
                parents.setdefault(name, set()).update(
                    v.id for k, v in zip(value.keys, value.values, strict=True) if k is None and isinstance(v, ast.Name)
                )
            elif isinstance(value, ast.Call):
                func = value.func
                if isinstance(func, ast.Attribute) and func.attr == "copy" and isinstance(func.value, ast.Name):
                    parents.setdefault(name, set()).add(func.value.id)
                elif isinstance(func, ast.Name) and func.id == "dict":
                    parents.setdefault(name, set()).update(a.id for a in value.args if isinstance(a, ast.Name))
                    keys.setdefault(name, set()).update(k.arg for k in value.keywords if k.arg)
    for node in ast.walk(tree):  # d.update(key=...)
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and func.attr == "update" and isinstance(func.value, ast.Name):
            keys.setdefault(func.value.id, set()).update(k.arg for k in node.keywords if k.arg)
    changed = True
    while changed:  # copies of copies
        changed = False
        for name, sources in parents.items():
            inherited = set().union(*(keys.get(s, set()) for s in sources)) - keys.get(name, set())
            if inherited:
                keys.setdefault(name, set()).update(inherited)
                changed = True
    return keys


def _builder_calls(tree: ast.AST, pairs) -> list[tuple[ast.Call, str]]:
    """Calls of transformers' mask builders, directly or through a local name bound to one (Mistral's
    ``mask_function = create_causal_mask if ... else create_sliding_window_causal_mask``)."""
    aliases: dict[str, str] = {}
    for targets, value in pairs:
        if isinstance(value, ast.Call | ast.Dict) or not isinstance(targets[0], ast.Name):
            continue
        used = [n for n in _BUILDERS if n in _names(value)]
        if used:
            aliases[targets[0].id] = used[0]
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (func.attr if isinstance(func, ast.Attribute) else None)
        builder = name if name in _POSITION_ARG else aliases.get(name) if isinstance(func, ast.Name) else None
        if builder is not None:
            calls.append((node, builder))
    return calls


def read_decoder_masks(decoder: torch.nn.Module, attn_implementation: str | None = None) -> DecoderMasks:
    """Read :class:`DecoderMasks` from the source of ``type(decoder).forward`` (unknown when it has none);
    ``attn_implementation``: the model's own (before Ulysses)."""
    eager = attn_implementation == "eager"
    numbering = _ids_numbering(decoder)
    by_ids = {} if numbering is None else {"ids_numbering": numbering[0], "positions_from_ids": numbering[1]}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(decoder).forward)))
    except (OSError, TypeError, SyntaxError):
        return DecoderMasks(documents=None, decoder=type(decoder).__name__, empty_rows_average=eager, **by_ids)
    pairs = _assignments(tree)
    keys = _dict_keys(tree, pairs)
    given = []
    for call, builder in _builder_calls(tree, pairs):
        positional = [a for a in call.args if not isinstance(a, ast.Starred)]
        given.append(
            len(positional) > _POSITION_ARG[builder]
            or any(k.arg == "position_ids" for k in call.keywords)
            or any(
                k.arg is None and isinstance(k.value, ast.Name) and "position_ids" in keys.get(k.value.id, ())
                for k in call.keywords
            )
        )
    tainted = {"attention_mask"}
    changed = True
    while changed:  # names whose values come from the attention mask
        changed = False
        for targets, value in pairs:
            if _names(value) & tainted:
                for target in targets:
                    if isinstance(target, ast.Name) and target.id not in tainted:
                        tainted.add(target.id)
                        changed = True
    return DecoderMasks(
        documents=all(given) if given else None,
        positions_from_mask="position_ids" in tainted,
        decoder=type(decoder).__name__,
        empty_rows_average=eager,
        **by_ids,
    )
