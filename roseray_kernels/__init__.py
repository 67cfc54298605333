"""roseray's Triton kernels (imported as `roseray_kernels`), each with a torch reference."""

from .activation import silu_and_mul, silu_and_mul_reference
from .fused_moe import MoETiles, choose_tiles, fused_moe
from .fused_norm import layernorm, layernorm_reference, rmsnorm, rmsnorm_reference
from .kv_append import kv_append, kv_append_index_put_baseline, kv_append_reference
from .moe_align import moe_align
from .paged_attention import choose_num_splits, paged_attention
from .rotary import rotary_qk_, rotary_qk_reference
from .sampling import gumbel_max_reference, gumbel_max_sample

__all__ = [
    "MoETiles",
    "choose_num_splits",
    "choose_tiles",
    "fused_moe",
    "gumbel_max_reference",
    "gumbel_max_sample",
    "kv_append",
    "kv_append_index_put_baseline",
    "kv_append_reference",
    "layernorm",
    "layernorm_reference",
    "moe_align",
    "paged_attention",
    "rmsnorm",
    "rmsnorm_reference",
    "rotary_qk_",
    "rotary_qk_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]
