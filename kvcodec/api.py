"""kvcodec public API (filled below)."""
