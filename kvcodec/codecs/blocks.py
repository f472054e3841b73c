"""Channel blocks of a head: the one partition the calibration and the fused decoder share.

Why: the inverse transform costs every output element one multiply-add per nonzero
coefficient of its row, so a head of D channels costs D times per element what one
channel does -- at head_dim 256 four times head_dim 64's. A basis whose columns each
touch only one block of channels (a block-diagonal PCA, built by
:func:`kvcodec.calibration.fit.compute_pca`) caps that at the block's width. The
format does not change: a zero basis entry adds an exact zero to the spec's sum, so the
fused decoder (:mod:`kvcodec.decode.cpu.simd`) may skip it, and it skips whole blocks where a
column is zero. Decoders that do not skip still decode the same bits.
"""

from __future__ import annotations

#: Most 16-lane vectors in one block: 64 channels, the head size whose decode meets
#: the speed target (benchmarks/BENCHMARKS.md, "Decode speed at every head_dim").
BLOCK_LANES = 4
LANES = 16

__all__ = ["channel_blocks", "BLOCK_LANES"]


def channel_blocks(head_dim: int) -> list[tuple[int, int]]:
    """Contiguous channel ranges ``[(start, stop), ...]`` covering ``head_dim``: the 16-channel
    groups split as evenly as possible into the fewest blocks of at most :data:`BLOCK_LANES` groups
    (64 -> one block, 96 -> 48 + 48, 128 -> 2 x 64, 256 -> 4 x 64). A head_dim that is not a multiple
    of 16, or at most 64, is one block."""
    if head_dim % LANES or head_dim <= LANES * BLOCK_LANES:
        return [(0, head_dim)]
    nb = head_dim // LANES
    n = -(-nb // BLOCK_LANES)
    cuts = [LANES * (nb * i // n) for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]
