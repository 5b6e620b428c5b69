"""`pdserve bench profile`: an AIPerf-compatible load generator for any OpenAI-compatible
endpoint, and the tools around it (compare, sweep, the comparison with AIPerf).

Runs on the base install: a tokenizer, asyncio sockets and numpy; never vLLM or torch.
Modules, one concept each:
  config     the command line (AIPerf's flags and aliases) -> ProfileConfig
  tokenizer  loading the tokenizer that counts tokens (never silently another model's)
  prompts    prompts with exact token counts, shared prefixes, sessions
  dataset    what to send: synthetic requests, Mooncake traces, fixed schedules
  http       a lean HTTP/1.1 + SSE client with byte-arrival timestamps
  runner     scheduling (concurrency, rate, arrival process, duration) over client processes
  records    one request's raw timings -> parsed record
  metrics    one function per metric, formula in the docstring
  stats      avg/min/max/sum/percentiles/std of a metric
  export     console table, profile_export.jsonl, profile_export_aiperf.json/.csv
  plots      PNG plots of a run
  compare    `pdserve bench compare A B`
  sweep      `pdserve bench sweep`: concurrencies -> Pareto table + PNG
  vs_aiperf  `pdserve bench loadgen-vs-aiperf`: this generator against AIPerf on the fake server
  errors     LoadgenError (a bench.errors.BenchError), TokenizerError, DatasetError
The fake server it is tested against is bench.testing.fake_server.
"""
