"""Debugging aids, registered as built-in plugins: the mismatch detector and the trace wrap every
operation hook while switched on; the flight recorder is called by the core's dispatch itself.

* :mod:`~pluribus.debug.detail` (``PLURIBUS_DEBUG=DETAIL``): ranks compare their calls before
  each collective and a mismatch raises on every rank.
* :mod:`~pluribus.debug.flight_recorder` (on under ``pluribus-run``,
  ``PLURIBUS_FLIGHT_RECORDER=N``): the last N calls, dumped when something fails so that
  ``pluribus-run`` can say where ranks were.
* :mod:`~pluribus.debug.trace` (``PLURIBUS_TRACE=DIR``): a Perfetto trace file per rank.
"""
