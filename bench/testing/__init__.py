"""Test doubles that ship, because documented commands use them.

  fake_server  `pdserve bench fake-server`: a fast OpenAI-compatible server with programmed
               delays and failures; the load generator's tests and `bench loadgen-vs-aiperf`
               run against it. It says what it is: `owned_by: pdserve-fake`, ids `*-fake`.
  errors       FakeServerError (a bench.errors.BenchError)
"""
