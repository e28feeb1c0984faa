"""pluribus-gloo: the default CPU backend of pluribus.

A full mesh of TCP connections between ranks, with shared-memory rings between ranks on the same
host, and native collectives over them. Pure Python and numpy; nothing else to install. The
plugin module (:mod:`pluribus_gloo.plugin`) is what the ``pluribus`` entry point loads.
"""

__version__ = "0.1.0"
