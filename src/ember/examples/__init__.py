"""Runnable examples: `python -m ember.examples.<name>`."""
