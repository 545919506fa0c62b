"""Flax NNX tensor-parallel layers over padded uneven blocks (local view).

Each layer's ``__call__`` runs inside a ``jax.shard_map`` body over a mesh
with a ``'tp'`` axis and sees this device's block; ``ntp_jax.layers.shard.tp_call``
runs a layer on global arrays.
"""

from ntp_jax.layers.attention import Attention
from ntp_jax.layers.cross_entropy import vocab_parallel_cross_entropy
from ntp_jax.layers.embedding import VocabParallelEmbed
from ntp_jax.layers.linear import ColumnParallelLinear, RowParallelLinear
from ntp_jax.layers.mlp import SwiGLU
from ntp_jax.layers.norm import RMSNorm
from ntp_jax.layers.params import TPParam, local_block, tp_param
from ntp_jax.layers.rope import apply_rope, rope_angles
from ntp_jax.layers.stack import REMAT_POLICIES, run_layers, stack_layers

__all__ = [
    "Attention", "ColumnParallelLinear", "REMAT_POLICIES", "RMSNorm", "RowParallelLinear",
    "SwiGLU", "TPParam", "VocabParallelEmbed", "apply_rope", "local_block", "rope_angles",
    "run_layers", "stack_layers", "tp_param", "vocab_parallel_cross_entropy",
]
