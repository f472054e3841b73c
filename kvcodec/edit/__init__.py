"""Offline KV-cache editing (issue 37): turn a stored entry into a new, edited one.

``append`` extends a context by prefilling only the new text; ``redact`` removes spans, re-positions the
later tokens and recomputes the most affected ones CacheBlend-style. Every edited file records its edit log
(:mod:`kvcodec.edit.log`, spec/kvc-v1.md §4.5). Guide: docs/guide/edit.md.
"""
