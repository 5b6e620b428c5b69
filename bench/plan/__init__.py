"""`pdserve plan`: aggregated vs disaggregated layouts under TTFT/TPOT targets.

  specs      model shapes and system specs (data/models.json, data/systems.json, cpu-local)
  perf       the performance model: step times, aggregated and disaggregated predictions
  search     enumerate layouts within the GPU budget, keep those meeting the targets, rank
  report     table, plan.json, CSVs, Pareto PNG, launch and load-test commands
  calibrate  `pdserve bench calibrate` (fit cpu-local) and `pdserve bench compare-plan`
No vLLM or torch: it runs on the base install.
"""
