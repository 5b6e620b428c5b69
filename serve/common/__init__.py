"""What several packages share, as leaf modules: they import nothing from pdserve.

- `names`: the embedded model's name and where pdserve keeps its files;
- `sse`: reading Server-Sent Events (`data: ...` lines) from an OpenAI stream;
- `procs`: children in their own process group (start, readiness, stop) and the `/proc` walker.

`bench`, `tests` and `serve` itself use these; `router` and `kvtransfer` need none of them.
"""
