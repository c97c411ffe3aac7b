"""Benchmark scripts of seqpar_hf; see benchmarks/README.md. Run each from the repository root as
`python -m benchmarks.<name>`."""
