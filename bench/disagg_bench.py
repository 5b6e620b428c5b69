"""`python -m bench.disagg_bench` (as the README documents it): runs bench.perf.disagg_bench, where it lives now."""

from bench.perf.disagg_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
