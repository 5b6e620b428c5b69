"""`python -m bench.frontend_overhead` (as the README documents it): runs bench.perf.frontend_overhead, where it lives now."""

from bench.perf.frontend_overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
