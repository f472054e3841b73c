"""Test and benchmark tooling shipped with kvcodec (as zarr ships zarr.testing): local servers on loopback,
a link shaper, the golden-vector generator and checker, the structure-aware fuzzer, and the store tier
conformance suite (``kvcodec.testing.store.TierTests``, which every tier's test subclasses)."""
