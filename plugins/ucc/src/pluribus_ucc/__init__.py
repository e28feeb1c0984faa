"""pluribus-ucc: the ``ucc`` backend, collectives over UCX through ucxx.

Importing this package loads neither ucxx nor UCX; the backend imports them when it is probed or
created.
"""

__version__ = "0.1.0"
