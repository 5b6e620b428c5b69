"""The simulated engine on a virtual clock: `serve.sim.engine.SimEngine`'s scheduler, block
table and step model unchanged, driven by the offline loop instead of asyncio, with a lean
sampler. Tokens never become text offline, so a token is a cheap function of the request
and position (not `serve.sim.tokens.token_at`), requests run to `max_tokens` (EOS off, as a
benchmark's `ignore_eos`), and the prefix cache registers each output block once, when it
fills. Each token's virtual time goes to `token_times[request_id]`; the first and the last
are also handed to `on_token(req)`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from serve.sim.blocks import BlockTable
from serve.sim.engine import SimConfig, SimEngine, SimRequest
from serve.sim.timing import StepModel
from serve.sim.tokens import Vocabulary

from bench.sim.loop import Loop

_VOCAB = Vocabulary.from_model_dir(None)  # unused offline (no sampling through it); built once
VOCAB_SPAN = 30000  # offline output ids lie in [1000, 31000): real-looking, never special


def output_token(seed: int, position: int) -> int:
    """The offline token at `position` of the answer to a prompt with `seed`; the workload
    uses the same function to put earlier answers in later turns' prompts."""
    return 1000 + (seed * 2654435761 + position * 40503) % VOCAB_SPAN


class OfflineEngine(SimEngine):
    def __init__(self, cfg: SimConfig, step_model: StepModel, table: BlockTable, loop: Loop,
                 on_token: Callable[[SimRequest], None], on_idle: Callable[[], None] | None = None) -> None:
        super().__init__(cfg, _VOCAB, step_model, table, clock=loop.clock)
        self.loop = loop
        self.on_token = on_token
        self.busy = False
        self.stopped = False
        self.busy_s = 0.0  # virtual seconds spent in steps
        # request id -> where its tokens' times go (the client's view); `on_token` is called
        # only for a request's first token and its last, the ones the cluster acts on.
        self.token_times: dict[str, array] = {}

    # -- the step loop on the virtual clock ---------------------------------------------
    def kick(self) -> None:
        """Start a step if the engine is idle and has work that fits."""
        if self.busy or self.stopped:
            return
        batch = self.schedule()
        if not batch:
            return
        self.busy = True
        dt = self.step_time(batch)
        self.busy_s += dt
        self.loop.after(dt, self._done, batch)

    def _done(self, batch: list[tuple[SimRequest, int]]) -> None:
        self.busy = False
        if self.stopped:
            return
        self.complete(batch)
        self.kick()

    # -- sampling ------------------------------------------------------------------------
    keyed = False  # tokens come from `output_token(seed, position)`: no prompt hash per request

    def _sample(self, req: SimRequest) -> None:  # once per token: kept lean
        out = req.output
        n = len(out) + 1  # the output's length with this token
        out.append(output_token(req.sampling.seed or 0, req.offset + n - 1))
        self.counters.generation_tokens += 1
        # A block that filled with this step's KV (the context but the new token) joins the
        # cache; the prefill's commit registered every full block before the first token.
        if n > 1:
            plen = len(req.prompt)
            computed = plen + n - 1
            table = self.table
            bs = table.block_size
            if computed % bs == 0:
                start = computed - bs
                if start >= plen:
                    block = out[start - plen:computed - plen]
                else:
                    block = req.prompt[start:] + out[:computed - plen]
                if table.committed(req.request_id) == start // bs:
                    table.commit_next(req.request_id, block)
        times = self.token_times.get(req.request_id)
        if times is not None:
            times.append(self.loop.now)
        if n >= req.sampling.max_tokens:
            self._finish(req, "length", announce=False)
            self.token_times.pop(req.request_id, None)
            self.on_token(req)
        elif n == 1:
            self.on_token(req)
