"""The benchmarks behind `edgeps bench`: one module per measurement (edgeps/cli/bench.py runs them)."""
