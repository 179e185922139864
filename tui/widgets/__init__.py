"""The panels of ``minipaged watch``: one widget per module."""
