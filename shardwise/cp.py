"""Context-parallel sequence layouts: which positions each CP rank holds, and its causal work.

With causal attention the query at position i attends to i + 1 keys, so the work of a rank is
`sum(i + 1 for i in its positions)`.

- contiguous: rank r holds [r*m, (r+1)*m), m = S / CP. Simple, and unbalanced: the last rank works most.
- zigzag: the sequence is cut into 2*CP blocks; rank r holds blocks r and 2*CP-1-r. Balanced, but depends
  on a fixed total length, so it suits prefill (S % (2*CP) == 0). S=32, CP=4: every rank does 132.
- striped: position i lives on rank i mod CP. Balanced, needs no fixed length; new decode tokens land
  on their rank directly.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shardwise.api import CpLayout


def positions(seq_len: int, cp: int, layout: CpLayout) -> list[npt.NDArray[np.int64]]:
    """Positions held by each CP rank, each array sorted; raises ValueError when the layout needs a
    length the sequence does not have."""
    if cp < 1 or seq_len < 0:
        raise ValueError(f"need cp >= 1 and seq_len >= 0, got cp={cp}, seq_len={seq_len}")
    idx = np.arange(seq_len, dtype=np.int64)
    if layout is CpLayout.STRIPED:
        return [idx[r::cp] for r in range(cp)]
    if layout is CpLayout.CONTIGUOUS:
        if seq_len % cp:
            raise ValueError(f"contiguous layout needs S % CP == 0, got S={seq_len}, CP={cp}")
        return list(idx.reshape(cp, -1))
    if seq_len % (2 * cp):
        raise ValueError(f"zigzag layout needs S % (2*CP) == 0, got S={seq_len}, 2*CP={2 * cp}")
    blocks = idx.reshape(2 * cp, -1)
    return [np.concatenate([blocks[r], blocks[2 * cp - 1 - r]]) for r in range(cp)]


def causal_work(seq_len: int, cp: int, layout: CpLayout) -> list[int]:
    """K/V positions each rank processes under a causal mask (sum of i + 1 over its positions)."""
    return [int((p + 1).sum()) for p in positions(seq_len, cp, layout)]


def imbalance(seq_len: int, cp: int, layout: CpLayout) -> float:
    """max / mean causal work over the CP ranks (1.0 = perfectly balanced)."""
    work = causal_work(seq_len, cp, layout)
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0
