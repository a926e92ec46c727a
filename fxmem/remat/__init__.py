"""Recompute: which forward values the backward keeps, and the forward/backward split."""
