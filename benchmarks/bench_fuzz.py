"""Structure-aware fuzzing of the .kvc reader (the engine is kvcodec.testing.fuzz; see its --help)."""

from kvcodec.testing.fuzz import main

if __name__ == "__main__":
    main()
