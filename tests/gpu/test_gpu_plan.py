"""The planner against one real step measured on a CUDA device (skipped without one)."""

import pytest
import torch

from ulysses_sp.features import Features
from ulysses_sp.simulate import simulate_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    "model,seq_len,sp,features",
    [
        ("qwen3-4b", 16384, 1, Features.baseline()),
        (
            "qwen3-4b",
            131072,
            8,
            Features(tiled_mlp=False, activation_checkpointing="checkpoint", cpu_offload_optimizer=True),
        ),
        (
            "llama-3.1-8b",
            262144,
            8,
            Features(tiled_mlp=False, activation_checkpointing="checkpoint", cpu_offload_optimizer=True),
        ),
    ],
)
def test_simulate_on_gpu_agrees_with_the_plan(model, seq_len, sp, features, gpu_record):
    result = simulate_step(model, seq_len=seq_len, sp=sp, dp=1, device="cuda", features=features)
    gpu_record(result=result)
    assert 0.85 <= result["ratio"] <= 1.15, result
