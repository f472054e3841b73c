"""Write or check the golden vectors in spec/vectors/ (the generator is kvcodec.testing.golden; never overwrites)."""

import sys

from kvcodec.testing.golden import main

if __name__ == "__main__":
    sys.exit(main())
