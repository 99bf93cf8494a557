"""Attention over the paged KV pool: the per-forward metadata and the attention paths."""

from sglang_admin.model.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    ExtendSeq,
    PagedDecode,
)
from sglang_admin.model.attention.paged import extend_attention, gather_rows, paged_attention

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "ExtendSeq",
    "PagedDecode",
    "extend_attention",
    "gather_rows",
    "paged_attention",
]
