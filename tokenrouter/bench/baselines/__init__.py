"""Baselines the routed runtime is measured against (step-synchronous, standard serving)."""
