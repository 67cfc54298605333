"""roseray's Triton kernels (imported as `roseray_kernels`), each with a torch reference."""

from .kv_append import kv_append, kv_append_index_put_baseline, kv_append_reference
from .paged_attention import choose_num_splits, paged_attention

__all__ = [
    "choose_num_splits",
    "kv_append",
    "kv_append_index_put_baseline",
    "kv_append_reference",
    "paged_attention",
]
