"""``python -m kvcodec`` is the ``kvc`` command."""

from kvcodec.cli.main import main

main()
