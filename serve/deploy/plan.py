"""The plan file (`plan.json`, schema "pdserve.plan/1"): what a planner hands to a deployer.

`pdserve plan` (bench/plan) builds a `Plan` and writes it; `pdserve k8s render` and
`pdserve bench compare-plan` read it back with `load_plan`. The Structs below are the whole
file, key for key and in the order it is written:

    Plan
    ├── inputs       Inputs: the command line of `pdserve plan`
    ├── model        Model: the shape the prediction used
    ├── system       System: the system profile the prediction used (self-contained: a
    │                reader never re-reads data files or calibrated profiles)
    ├── targets      Targets: TTFT and TPOT, ms
    ├── kv_dtype     the KV cache dtype modelled (plans before it: inputs.kv_dtype)
    ├── agg_best, disagg_best       PlannedLayout | None: the best layout meeting the targets
    ├── winner       "agg" | "disagg" | None, and disagg_over_agg (tokens/s/GPU ratio)
    ├── agg_top, disagg_top         the ten best of each, best first
    ├── pareto       Pareto: both fronts, tokens/s/GPU against tokens/s/user
    ├── searched     Searched: how many layouts, how long
    └── launch, load_test           Launch | None, str | None: the commands of the winner

Unknown keys are ignored (a newer minor writer stays readable); fields added after the first
files were written have defaults, so every file written so far still loads.

Errors: DeployError (a serve.errors.PdserveError), one line naming the file. This module is
serve's: it may not import bench, router or kvtransfer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from serve.errors import PdserveError

PLAN_SCHEMA = "pdserve.plan/1"
PLAN_FILE = "plan.json"
# Factors that leave a disaggregated prediction unchanged (plans written before the
# system profile had a "disagg" block).
DISAGG_NEUTRAL = {"prefill_latency": 1.0, "decode_latency": 1.0, "prefill_utilisation": 0.95,
                  "decode_occupancy": 1.0}

Mode = Literal["agg", "disagg"]


class DeployError(PdserveError):
    """A plan that cannot be read, or a layout that cannot be deployed as asked."""


class Inputs(msgspec.Struct, frozen=True):
    """`pdserve plan`'s inputs (positional in this order, like its flags)."""

    model: str
    system: str
    total_gpus: int
    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float
    backend: str = "vllm"
    kv_dtype: str = "bf16"  # the model's dtype, as vLLM's --kv-cache-dtype auto and AIConfigurator default to
    weight_dtype: str = "bf16"
    network: str = "rdma"
    roofline_only: bool = False  # one set of efficiencies for every system, not each system's measured kernels


class Model(msgspec.Struct, frozen=True):
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False


class System(msgspec.Struct, frozen=True):
    name: str
    peak_tflops: dict[str, float]
    hbm_gbps: float
    memory_gib: float
    nvlink_gbps: float
    network_gbps: dict[str, float]
    efficiency: dict[str, float]
    step_overhead_ms: float
    kv_memory_fraction: float = 0.9
    max_num_batched_tokens: int = 8192
    gpus_per_node: int = 8
    activation_reserve_gib: float = 2.0
    chunked_prefill: bool = True  # the engine's setting: off, a prompt goes through whole in one step
    allreduce_latency_us: float = 10.0  # one TP all-reduce's fixed cost (launch + synchronisation)
    layer_floor_us: float = 0.0  # per layer and step: the fixed latency of its GEMM and attention kernels
    # A measured all-reduce per TP: {GPUs: [[message bytes, latency us], ...]} (interpolated;
    # stands for allreduce_latency_us and the NVLink bandwidth at the TPs it covers).
    allreduce_curve: dict[str, list[list[float]]] | None = None
    disagg: dict[str, float] = msgspec.field(default_factory=lambda: dict(DISAGG_NEUTRAL))
    sources: dict[str, str] = msgspec.field(default_factory=dict)
    # A measured step-time profile (pdserve.profile/1) standing for this system: its step
    # model replaces the roofline (bench/plan/perf.py, Engine.step_s).
    step_profile: dict[str, Any] | None = None


class Targets(msgspec.Struct, frozen=True):
    ttft_ms: float
    tpot_ms: float


class Pool(msgspec.Struct, frozen=True):
    """One pool of identical workers."""

    replicas: int
    tp: int
    max_num_seqs: int


class PlannedLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A layout and its prediction. Aggregated: `replicas` engines of `tp` GPUs, `batch`
    requests each; disaggregated: the prefill_* and decode_* pools (the others are 0)."""

    mode: Mode
    tp: int = 1
    replicas: int = 0
    batch: int = 0
    prefill_tp: int = 0
    prefill_workers: int = 0
    prefill_batch: int = 0
    decode_tp: int = 0
    decode_workers: int = 0
    decode_batch: int = 0
    meets: bool = True
    layout: str
    ttft_ms: float
    tpot_ms: float
    request_latency_ms: float
    requests_per_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    concurrency: float
    gpus: int

    def pools(self) -> dict[str, Pool]:
        """Role ("agg", or "prefill" and "decode") -> its pool."""
        if self.mode == "agg":
            return {"agg": Pool(self.replicas, self.tp, self.batch)}
        return {"prefill": Pool(self.prefill_workers, self.prefill_tp, self.prefill_batch),
                "decode": Pool(self.decode_workers, self.decode_tp, self.decode_batch)}


class Pareto(msgspec.Struct, frozen=True):
    agg: list[PlannedLayout] = msgspec.field(default_factory=list)
    disagg: list[PlannedLayout] = msgspec.field(default_factory=list)


class Searched(msgspec.Struct, frozen=True):
    agg: int
    disagg: int
    seconds: float


class Launch(msgspec.Struct, frozen=True):
    """`pdserve up` for one node; the frontend and one `pdserve worker` per worker for clusters."""

    up: str
    frontend: str
    workers: list[str]


NEAR_TIE = 0.05  # best agg and disagg tokens/s/GPU within 5%: a near tie


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    schema: str = PLAN_SCHEMA
    inputs: Inputs
    model: Model
    system: System
    targets: Targets
    kv_dtype: str | None = None
    agg_best: PlannedLayout | None = None
    disagg_best: PlannedLayout | None = None
    winner: Mode | None = None
    disagg_over_agg: float | None = None
    agg_top: list[PlannedLayout] = msgspec.field(default_factory=list)
    disagg_top: list[PlannedLayout] = msgspec.field(default_factory=list)
    pareto: Pareto = msgspec.field(default_factory=Pareto)
    searched: Searched
    launch: Launch | None = None
    load_test: str | None = None
    # Best aggregated and disaggregated within NEAR_TIE of each other: the model cannot pick
    # between them; measure both (the other architecture's launch and load test follow).
    near_tie: bool = False
    other_launch: Launch | None = None
    other_load_test: str | None = None

    @property
    def kv_cache_dtype(self) -> str:
        """The KV dtype the prediction modelled."""
        return self.kv_dtype or self.inputs.kv_dtype

    def best(self, layout: Literal["winner", "agg", "disagg"] = "winner") -> PlannedLayout | None:
        """The winner's layout, or the best of one architecture (None where none met the targets)."""
        mode = self.winner if layout == "winner" else layout
        return {"agg": self.agg_best, "disagg": self.disagg_best}.get(mode) if mode else None

    def to_json(self) -> bytes:
        """plan.json's bytes: every field (None included), indented, newline-terminated."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"


def plan_file(path: str | Path) -> Path:
    """plan.json itself for `path` or the directory holding it."""
    p = Path(path)
    return p / PLAN_FILE if p.is_dir() else p


def decode_plan(data: bytes | str, source: str = "plan") -> Plan:
    """A Plan from plan.json's text; DeployError (naming `source`) for anything else."""
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise DeployError(f"{source}: invalid JSON: {e}") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != PLAN_SCHEMA:
        raise DeployError(f"{source}: not a {PLAN_SCHEMA} plan (schema {schema!r})")
    try:
        return msgspec.convert(doc, Plan)
    except msgspec.ValidationError as e:
        raise DeployError(f"{source}: not a valid {PLAN_SCHEMA} plan: {e}") from None


def load_plan(path: str | Path) -> Plan:
    """The plan in `path`: plan.json itself, or the directory holding it (`--save-dir`)."""
    f = plan_file(path)
    try:
        data = f.read_bytes()
    except OSError as e:
        raise DeployError(f"{f}: {e.strerror or e}") from None
    return decode_plan(data, str(f))


def write_plan(plan: Plan, directory: str | Path) -> Path:
    """Write `directory`/plan.json (the directory is created); the file written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    f = d / PLAN_FILE
    f.write_bytes(plan.to_json())
    return f
