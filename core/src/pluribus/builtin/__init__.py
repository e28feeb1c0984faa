"""Plugins that ship with the core. They register through the same hooks as any other plugin."""
