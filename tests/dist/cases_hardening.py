"""Multi-rank cases for issue 8 (exactness and hardening), run inside gloo workers by tests/dist/test_hardening.py.

Parity cases compare loss and every gradient with one process on the full batch (plain transformers attention,
the model's own mask), as in :mod:`tests.dist.cases_core`; the other cases check that bad input on ONE rank
raises a ValueError on EVERY rank before any collective can hang.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from tests.dist.cases_core import check_parity
from tests.helpers.harness import run_cases
from tests.helpers.models import make_batch

import ulysses_sp as U

# Every family of the issue, tiny: (arch, kv_heads). heads=4 so sp=4 splits them.
PARITY_ARCHS = {
    "llama_dynamic": 2,  # rope "dynamic": frequencies from the largest position
    "phi3_longrope": 2,  # rope "longrope": long or short factors from the largest position
    "llama3_yarn": 2,
    "qwen2_moe_window": 2,  # sliding window only through the mask
    "phimoe_window": 2,  # sliding window only through the mask
    "deepseek_v3_mla": None,  # MLA, v head dim == qk head dim
    "deepseek_v3_mla_v4": None,  # MLA, v head dim 4 != qk head dim 8
    "deepseek_v2_mla_v4": None,
    "opt": None,  # the CausalLM calls its decoder directly
    "stablelm": 2,
    "granite": 2,
    "starcoder2": 2,
    "mixtral": 2,
    "qwen3_moe": 2,
    "smollm3": 2,
    "glm": 2,
    "glm4": 2,
    "phi": None,
    "exaone4": 2,
    "olmo3": 2,
    "ministral": 2,
}
# PhiMoE's router samples (Gumbel) in train mode: two runs never route alike, so it is compared in eval only.
EVAL_ONLY = {"phimoe_window"}


def parity_cases(layout, prefix: str, seq_len: int) -> dict:
    P = functools.partial
    cases = {}
    for arch, kv in PARITY_ARCHS.items():
        batch = make_batch(2, seq_len, packed=(seq_len - 9, 9)) if arch != "opt" else make_batch(2, seq_len)
        cases[f"{prefix}_{arch}_eval"] = P(check_parity, layout, arch, kv_heads=kv, batch=batch, train=False)
        if arch not in EVAL_ONLY:
            cases[f"{prefix}_{arch}_train"] = P(check_parity, layout, arch, kv_heads=kv, batch=batch, train=True)
    return cases


def world2_cases(sp2) -> dict:
    P = functools.partial
    return {
        **parity_cases(sp2, "sp2", 24),
        # 23 tokens: the padding shard_batch adds must not raise the largest position dynamic RoPE reads
        "sp2_llama_dynamic_padded_to_sp": P(check_parity, sp2, "llama_dynamic", kv_heads=2, batch=make_batch(2, 23)),
    }


def world4_cases(sp4) -> dict:
    return {**parity_cases(sp4, "sp4", 26)}


def world2() -> dict[str, str]:
    return run_cases(world2_cases(U.ParallelLayout.from_env(sp=2)))


def world4() -> dict[str, str]:
    return run_cases(world4_cases(U.ParallelLayout.from_env(sp=4)))


_NAMES = SimpleNamespace(sp=1, sp_rank=0, dp=1, dp_rank=0)  # case names only: no process group needed
WORLD2 = sorted(world2_cases(_NAMES))
WORLD4 = sorted(world4_cases(_NAMES))
