"""`pdserve plan`: aggregated vs disaggregated layouts under TTFT/TPOT targets.

  specs      model shapes and system specs (bench.plan.data's models.json and systems.json,
             read with importlib.resources; cpu-local)
  perf       the performance model: step times, aggregated and disaggregated predictions
  search     enumerate layouts within the GPU budget, keep those meeting the targets, rank
  report     the Plan (serve.deploy.plan), table, plan.json, CSVs, Pareto PNG, launch commands
  calibrate  `pdserve bench calibrate` (fit cpu-local) and `pdserve bench compare-plan`
  cli        `pdserve plan`, and the parsers of `bench calibrate|compare-plan`
  errors     PlanError (a bench.errors.BenchError)
No vLLM or torch: it runs on the base install. `pdserve k8s render` (serve.deploy.k8s) reads
the plan it writes.
"""
