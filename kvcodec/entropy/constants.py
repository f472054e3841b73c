"""The constants of the rANS v1 bitstream (spec/rans-v1.md): the ONE place they are stated.

The CPU coder (:mod:`kvcodec.entropy.rans`), the probability model
(:mod:`kvcodec.entropy.model`) and the Triton decoder (``kvcodec.decode.triton.rans_kernel``) all
import them from here, so a kernel cannot drift from the reference by a restated literal.
Changing any value changes the bitstream: it would be rANS v2, never a silent edit.
"""

from __future__ import annotations

PROB_BITS = 12  # probability precision P
PROB_SCALE = 1 << PROB_BITS  # M = 4096: every frequency table sums to M
SLOT_MASK = PROB_SCALE - 1  # x & SLOT_MASK is the state's slot in [0, M)
RANS_L = 1 << 16  # lower bound of the state interval [L, 2**32); every lane starts and ends at L
WORD_BITS = 16  # renormalisation moves one 16-bit word
WORD_MASK = (1 << WORD_BITS) - 1
N_LANES = 32  # interleaved lanes per context: symbol i belongs to lane i % 32
STATE_BYTES = 4 * N_LANES  # final states per context (u32 per lane)
MAX_ALPHABET = 256  # symbols are uint8
# encoder: renormalise while x >= f << X_MAX_SHIFT (x_max = ((L >> P) << WORD_BITS) * f)
X_MAX_SHIFT = (RANS_L.bit_length() - 1) - PROB_BITS + WORD_BITS  # 20

# decoder lookup layouts (not bitstream: how the numba and Triton decoders pack their tables)
TABLE_FREQ_SHIFT = 8  # slot table entry: sym | (f - 1) << 8 | (slot - cum) << 20
TABLE_CUM_SHIFT = TABLE_FREQ_SHIFT + PROB_BITS
FC_CUM_SHIFT = 16  # binary-search entry: freq | cum << 16 (freq <= M fits below)
FC_SENTINEL = 1 << 28  # a cum above every slot: the search never steps past the alphabet

# error codes of the decode kernels (numba and Triton alike)
OK = 0
E_TRUNC = 1
E_LEB_LONG = 2
E_LEB_NONCANON = 3
E_FREQ_RANGE = 4
E_FREQ_SUM = 5
E_OVERRUN = 6
E_UNDERRUN = 7
E_FINAL_STATE = 8
