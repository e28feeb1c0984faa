"""``python -m pluribus.bench`` (also what ``pluribus-run ... -m pluribus.bench`` runs)."""

import sys

from .cli import main

sys.exit(main())
