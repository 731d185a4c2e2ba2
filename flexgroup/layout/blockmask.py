"""Deprecated: the analytic block tables now live in :mod:`flexgroup.layout.masks` (kept for old imports)."""

from __future__ import annotations

from .masks import block_tables, build_block_mask, check_block_size
from .masks import draw as draw_block_mask

__all__ = ["build_block_mask", "block_tables", "draw_block_mask", "check_block_size"]
