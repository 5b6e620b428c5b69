"""`python -m bench.router.micro` only (the benchmark itself: bench.perf.router_micro)."""
