"""Sections of the GPU checks (`benchmarks/gpu_check.py`), one module each: `run(device,
quick) -> dict` raises AssertionError on any correctness failure and returns its figures;
with device="cpu" and quick=True it runs the code paths it can on the CPU in seconds."""
