"""kvcodec plugin example: a stage, a decoder and a tier, declared as entry points in ../pyproject.toml."""
