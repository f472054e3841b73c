"""``python -m kvcodec.integrations.lmcache extract OBJECT OUT.kvc``: the `.kvc` inside a stored serde object.

Why: LMCache's ``fs`` adapter stores the serde's framed, padded object (kvcodec.integrations.lmcache.chunks);
``kvc info`` / ``kvc verify`` read the `.kvc` this writes.
"""

from __future__ import annotations

import sys

from kvcodec.errors import KvcError
from kvcodec.integrations.lmcache.chunks import unframe


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "extract":
        print("usage: python -m kvcodec.integrations.lmcache extract OBJECT OUT.kvc", file=sys.stderr)
        return 2
    try:
        with open(args[1], "rb") as f:
            data = unframe(f.read())
        with open(args[2], "wb") as f:
            f.write(data)
    except KvcError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 9
    print(f"{args[2]}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
