"""Benchmark scripts of seqpar_hf; see benchmarks/README.md. Run each as `python benchmarks/<name>.py`."""
