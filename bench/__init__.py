"""pdserve's client side: the load generator, the planner and the benchmarks.

  loadgen/  `pdserve bench profile|sweep|compare|loadgen-vs-aiperf`: AIPerf-compatible load
            generator for any OpenAI-compatible endpoint
  plan/     `pdserve plan`, `bench calibrate|compare-plan`: the planner; it writes a
            serve.deploy.plan.Plan (plan.json)
  perf/     benchmarks that start pdserve itself (`bench soak|engine-memory|kv`, routing,
            disaggregation, frontend overhead, router decisions)
  testing/  test doubles that ship: `pdserve bench fake-server`
  cli       `pdserve bench ...` (add_command, run)
  errors    BenchError, the root of every tool's errors
  files     reading the JSON files the tools exchange

bench may import serve, router and kvtransfer; none of them imports bench. `bench profile`
and `plan` need neither vLLM nor torch.
"""
