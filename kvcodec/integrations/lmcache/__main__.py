"""``python -m kvcodec.integrations.lmcache extract OBJECT OUT.kvc``: the `.kvc` inside a stored serde object.
``python -m kvcodec.integrations.lmcache server ARGS...``: ``lmcache server ARGS...`` with the serde registered.

Why: LMCache's ``fs`` adapter stores the serde's framed, padded object (kvcodec.integrations.lmcache.chunks);
``kvc info`` / ``kvc verify`` read the `.kvc` this writes. LMCache 0.5.6 has no entry point for third-party
serdes, so ``"serde": {"type": "kvcodec"}`` in an ``--l2-adapter`` needs :func:`register` called in the server's
process before it parses its arguments: ``server`` does that, then runs LMCache's own CLI.
"""

from __future__ import annotations

import sys

from kvcodec.errors import KvcError
from kvcodec.integrations.lmcache.chunks import unframe


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["server"]:
        from kvcodec.integrations.lmcache import register

        try:
            register()  # one line where lmcache is not installed (a ModuleNotFoundError traceback before)
        except KvcError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        from lmcache.cli.main import main as lmcache_main

        lmcache_main(args)
        return 0
    if len(args) != 3 or args[0] != "extract":
        print("usage: python -m kvcodec.integrations.lmcache extract OBJECT OUT.kvc\n"
              "       python -m kvcodec.integrations.lmcache server LMCACHE_SERVER_ARGS...", file=sys.stderr)
        return 2
    # Why these helpers: a plain open() blocked forever on a FIFO, read /dev/zero until memory ran out, and wrote
    # the output in place: onto the object itself (the input destroyed), a FIFO (blocked) or a device.
    from kvcodec.atomic import atomic_write_bytes
    from kvcodec.limits import open_regular

    try:
        with open(open_regular(args[1], "an LMCache object"), "rb") as f:
            data = unframe(f.read())
        atomic_write_bytes(args[2], data, inputs=[args[1]])
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
