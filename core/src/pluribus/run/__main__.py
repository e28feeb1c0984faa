"""``python -m pluribus.run``: the same as the ``pluribus-run`` command."""

from . import main

main()
