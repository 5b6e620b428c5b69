"""A simulated engine behind the real worker protocol (`pdserve worker --engine sim`).

- `blocks`: the KV block table (capacity, prefix cache on router.hashing's hashes, LRU);
- `tokens`: output tokens, a pure function of prompt, position, sampling and seed;
- `timing`: the pluggable step model, `step_seconds(decode_contexts, prefill_chunks)`;
- `engine`: the continuous-batching scheduler;
- `kv`: prefill/decode KV hand-off over the real side channel and lease table;
- `events`: KV events in vLLM's wire format;
- `config`: engine flags -> options; `backend`: the `EngineBackend`; `worker`: serving them.

It needs neither vLLM nor torch, and says it is simulated in everything it emits.
"""
