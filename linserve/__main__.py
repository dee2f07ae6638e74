"""``python -m linserve serve ...``: the same as the ``linserve`` command."""

from linserve.cli import main

main()
