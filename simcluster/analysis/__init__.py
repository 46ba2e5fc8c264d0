"""Analyses over many runs: the layout search (`simcluster plan`) and sweeps of one key."""
