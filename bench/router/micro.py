"""`python -m bench.router.micro` (as the README documents it): runs bench.perf.router_micro, where it lives now."""

from bench.perf.router_micro import main

if __name__ == "__main__":
    raise SystemExit(main())
