"""Entropy coders. ``rans``: interleaved 32-lane rANS, bitstream v1 (spec/rans-v1.md)."""
