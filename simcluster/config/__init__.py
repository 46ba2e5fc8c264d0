"""The input: a scenario's keys, values and checks, and the command line's own options."""
