"""A run: the job a scenario describes, what it would cost, the emulator running it, and the three ways a
meta-mode run simulates less (folding identical ranks is the engine's: engine/fold.py; identical steps,
steady.py; identical pipeline rounds, pipeline_steady.py)."""
