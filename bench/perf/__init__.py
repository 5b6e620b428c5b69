"""Benchmarks of pdserve itself: they start pdserve's processes (and, to compare, vLLM's own
server) on this machine and measure them.

  soak               `pdserve bench soak`: long mixed load with aborts; failures, RSS, KV leaks
  engine_memory      `pdserve bench engine-memory`: a CPU engine's heap per oneDNN cache size
  disagg_bench       `python -m bench.disagg_bench routing|mixed`: kv vs round-robin; ITL p99
  frontend_overhead  `python -m bench.frontend_overhead`: pdserve vs vLLM's OpenAI server
  kv/                `pdserve bench kv`: NIXL READ/WRITE vs memcpy (micro); connectors (e2e)
  router_micro       `python -m bench.router.micro`: one routing decision's latency (no I/O)
  client             the small streaming chat client they share (serve.common.sse)
  servers            starting and stopping their servers (serve.common.procs)
  errors             PerfError (a bench.errors.BenchError)
"""
