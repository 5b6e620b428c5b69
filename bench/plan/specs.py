"""Model shapes and system specs: the planner's two inputs, from the data files shipped in
the package bench.plan.data (read with importlib.resources, so an installed wheel finds them
wherever it is and whatever the working directory), or a Hugging Face config directory, or
a calibrated system profile. `to_plan`/`from_plan` convert to and from plan.json's Structs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib.resources import files
from pathlib import Path
from typing import Any

import msgspec

from bench.plan.errors import PlanError
from bench.plan.kernels import KERNELS_FILE, shipped
from serve.deploy import plan as planfile
from serve.deploy.plan import DISAGG_NEUTRAL

DATA_PACKAGE = "bench.plan.data"


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @cached_property
    def params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        mlp = 3 * h * self.intermediate  # gate, up, down (SwiGLU)
        return attn + mlp

    @cached_property
    def linear_params(self) -> int:
        """Parameters multiplied per token: every layer's projections and MLP, and the LM head."""
        return self.layers * self.params_per_layer + self.vocab * self.hidden

    @cached_property
    def weight_params(self) -> int:
        """All parameters held in memory (embeddings counted once when tied)."""
        emb = self.vocab * self.hidden
        return self.layers * self.params_per_layer + (emb if self.tied_embeddings else 2 * emb)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_plan(self) -> planfile.Model:
        return planfile.Model(**asdict(self))

    @classmethod
    def from_plan(cls, m: planfile.Model) -> "ModelShape":
        return cls(**msgspec.structs.asdict(m))


@dataclass(frozen=True)
class SystemSpec:
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
    activation_reserve_gib: float = 2.0  # per engine, besides weights and KV cache
    chunked_prefill: bool = True  # the engine's setting (CPU workers run without it)
    allreduce_latency_us: float = 10.0  # one TP all-reduce's fixed cost (launch + synchronisation)
    layer_floor_us: float = 0.0  # per layer and step: its kernels' fixed latency (measured kernels only)
    allreduce_curve: dict[str, list[list[float]]] | None = None  # measured all-reduce per TP (perf.py)
    # disaggregated-only factors (see perf.py): prefill_latency, decode_latency,
    # prefill_utilisation, decode_occupancy
    disagg: dict[str, float] = field(default_factory=lambda: dict(DISAGG_NEUTRAL))
    sources: dict[str, str] = field(default_factory=dict)
    step_profile: dict[str, Any] | None = None  # a pdserve.profile/1 document (see `system_of_profile`)

    def to_dict(self) -> dict[str, Any]:
        """The layout of a system profile file (what `pdserve bench calibrate` writes)."""
        return asdict(self)

    def to_plan(self) -> planfile.System:
        return planfile.System(**asdict(self))

    @classmethod
    def from_plan(cls, s: planfile.System) -> "SystemSpec":
        return cls(**msgspec.structs.asdict(s))


def _read(path: Path) -> dict[str, Any]:
    from bench.files import read_json

    return read_json(path, None, PlanError)[1]


def data_file(name: str) -> dict[str, Any]:
    """A JSON data file shipped in bench.plan.data."""
    res = files(DATA_PACKAGE).joinpath(name)
    try:
        return json.loads(res.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"{DATA_PACKAGE}/{name}: {e.strerror or e} (is pdserve installed with its data files?)") from None
    except ValueError as e:
        raise PlanError(f"{DATA_PACKAGE}/{name}: invalid JSON: {e}") from None


def known_models() -> dict[str, dict[str, Any]]:
    return {k: v for k, v in data_file("models.json").items() if not k.startswith("_")}


def _shape(name: str, c: dict[str, Any]) -> ModelShape:
    return ModelShape(name=name, hidden=c["hidden"], layers=c["layers"], heads=c["heads"], kv_heads=c["kv_heads"],
                      head_dim=c["head_dim"], intermediate=c["intermediate"], vocab=c["vocab"],
                      tied_embeddings=bool(c.get("tied_embeddings", False)))


def load_model(name: str) -> ModelShape:
    """A known model by name (with or without its organisation), or a Hugging Face config
    directory (or config.json) of a dense decoder-only model."""
    p = Path(name).expanduser()
    if p.exists():
        cfg_file = p / "config.json" if p.is_dir() else p
        c = _read(cfg_file)
        try:
            heads = c["num_attention_heads"]
            return ModelShape(
                name=p.resolve().name if p.is_dir() else p.parent.resolve().name, hidden=c["hidden_size"],
                layers=c["num_hidden_layers"], heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate=c["intermediate_size"],
                vocab=c["vocab_size"], tied_embeddings=bool(c.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise PlanError(f"{cfg_file}: missing {e.args[0]!r} (a dense decoder-only model's config is needed)") from None
    models = known_models()
    want = name.lower()
    for full, c in models.items():
        names = {full.lower(), full.split("/", 1)[-1].lower(), *[a.lower() for a in c.get("aliases", [])]}
        if want in names:
            return _shape(full, c)
    raise PlanError(f"unknown model {name!r}: known: {', '.join(models)}; or pass a Hugging Face config directory")


def system_names() -> list[str]:
    return sorted(data_file("systems.json")["systems"]) + ["cpu-local"]


def cpu_local_path() -> Path:
    from serve.common.names import cache_root

    return cache_root() / "plan" / "cpu-local.json"


KERNEL_MEASURES = ("gemm", "hbm", "prefill_attention", "decode_attention", "nvlink")


def _kernel_efficiencies(name: str, defaults: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], str] | None:
    """(efficiencies, {allreduce_latency_us, layer_floor_us, step_overhead_ms}, source) of a
    system whose kernels were measured (bench.plan.kernels): each measured figure times the
    defaults' fitted `kernel_scale` (which carries its own step overhead, fitted with the scales)."""
    scale = defaults.get("kernel_scale")
    try:
        measured = shipped().get(name)
    except (ValueError, KeyError) as e:
        raise PlanError(f"{DATA_PACKAGE}/{KERNELS_FILE}: {e}") from None
    if not scale or not measured:
        return None
    eff = {k: min(1.0, scale[k] * measured[k]) for k in KERNEL_MEASURES}
    src = (f"{DATA_PACKAGE}/{KERNELS_FILE} (python -m bench.plan.kernels: this system's own measured vLLM kernels, "
           f"AIConfigurator's per-operation tables) times systems.json's kernel_scale")
    fixed = {k: scale[k] * measured[k] for k in ("allreduce_latency_us", "layer_floor_us")}
    curve = scale_curve(measured.get("allreduce_us"), scale["allreduce_latency_us"])
    return eff, {**fixed, "step_overhead_ms": scale["step_overhead_ms"], "allreduce_curve": curve}, src


def scale_curve(curve: dict[str, list[list[float]]] | None, scale: float) -> dict[str, list[list[float]]] | None:
    """A measured all-reduce curve with its latencies times `scale`."""
    return None if not curve else {n: [[b, us * scale] for b, us in pts] for n, pts in curve.items()}


def load_system(name: str, kernels: bool = True) -> SystemSpec:
    """A system from bench.plan.data's systems.json, `cpu-local` (the calibrated profile of this machine,
    written by `pdserve bench calibrate`), or a JSON file of the same layout. A systems.json system
    whose kernels were measured (kernels.json) takes its efficiencies, all-reduce curve and latency,
    per-layer kernel floor and step overhead from them and `kernel_scale` unless `kernels` is False
    (the roofline-only model: one set of efficiencies for every system, no floor)."""
    doc = data_file("systems.json")
    defaults = doc["defaults"]
    if name == "cpu-local" or name.endswith(".json"):
        path = cpu_local_path() if name == "cpu-local" else Path(name)
        if not path.is_file():
            hint = " run `pdserve bench calibrate ARTIFACT_DIR...` first" if name == "cpu-local" else ""
            raise PlanError(f"system profile {path} does not exist:{hint}")
        s = _read(path)
        if s.get("format") == PROFILE_FORMAT:
            return system_of_profile(s, str(path))
    elif name in doc["systems"]:
        s = doc["systems"][name]
    else:
        raise PlanError(f"unknown system {name!r}: known: {', '.join(system_names())}")
    eff = {**defaults["efficiency"], **s.get("efficiency", {})}
    allreduce_us = float(s.get("allreduce_latency_us", defaults.get("allreduce_latency_us", 10.0)))
    sources = {**defaults["sources"], **({"system": s["source"]} if "source" in s else {}), **s.get("sources", {})}
    fixed = {"allreduce_latency_us": allreduce_us, "layer_floor_us": 0.0, "allreduce_curve": None,
             "step_overhead_ms": s.get("step_overhead_ms", defaults["step_overhead_ms"])}
    measured = _kernel_efficiencies(name, defaults) if kernels and name in doc["systems"] else None
    if measured is not None and "efficiency" not in s:
        eff, fixed = {**eff, **measured[0]}, measured[1]
        sources = {**sources, **{k: measured[2] for k in (*KERNEL_MEASURES, *fixed) if fixed.get(k, 0) is not None}}
    disagg = {**DISAGG_NEUTRAL, **defaults.get("disagg", {}), **s.get("disagg", {})}
    bad = sorted(k for k, v in disagg.items() if k not in DISAGG_NEUTRAL or not 0 < float(v) <= 2)
    if bad:
        raise PlanError(f"system {name!r}: bad disagg factor(s) {', '.join(bad)}: known "
                        f"{', '.join(DISAGG_NEUTRAL)}, each in (0, 2]")
    return SystemSpec(
        name=s.get("name", name), peak_tflops=s["peak_tflops"], hbm_gbps=s["hbm_gbps"], memory_gib=s["memory_gib"],
        nvlink_gbps=s.get("nvlink_gbps", 25), network_gbps=s.get("network_gbps", {"rdma": 25, "tcp": 3}),
        efficiency=eff, step_overhead_ms=fixed["step_overhead_ms"],
        kv_memory_fraction=s.get("kv_memory_fraction", defaults["kv_memory_fraction"]),
        max_num_batched_tokens=s.get("max_num_batched_tokens", defaults["max_num_batched_tokens"]),
        gpus_per_node=s.get("gpus_per_node", 8), activation_reserve_gib=s.get("activation_reserve_gib", 2.0),
        chunked_prefill=bool(s.get("chunked_prefill", True)),
        allreduce_latency_us=fixed["allreduce_latency_us"], layer_floor_us=fixed["layer_floor_us"],
        allreduce_curve=fixed["allreduce_curve"], disagg={k: float(v) for k, v in disagg.items()}, sources=sources)


PROFILE_FORMAT = "pdserve.profile/1"


def system_of_profile(doc: dict[str, Any], where: str) -> SystemSpec:
    """A step-time profile (`pdserve.profile/1`, e.g. from `pdserve bench calibrate --steps`)
    as a planner system: its step model stands for the roofline (`Engine.step_s`), its
    `kv_cache_tokens` for the KV capacity of one engine, its `transfer` link for both
    networks. It was measured at one TP (`tp`), so the planner ranks layouts of that TP only.
    Its engines ran without chunked prefill (pdserve's CPU workers do) unless it says
    `"chunked_prefill": true`."""
    from serve.sim.profile import ProfileError, from_dict

    try:
        step = from_dict(doc, where)
    except ProfileError as exc:
        raise PlanError(str(exc)) from None
    tokens = doc.get("kv_cache_tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        raise PlanError(f"{where}: a profile used as a planner system needs kv_cache_tokens (the KV capacity of one "
                        "engine, in tokens; `pdserve bench calibrate --steps WORKER_URL` writes it)")
    tp = doc.get("tp", 1)
    if not isinstance(tp, int) or tp < 1:
        raise PlanError(f"{where}: tp must be an integer >= 1")
    net = {"rdma": step.transfer.bandwidth_gbps, "tcp": step.transfer.bandwidth_gbps} if step.transfer else \
        {"rdma": 25.0, "tcp": 3.0}
    ones = {k: 1.0 for k in ("gemm", "prefill_attention", "hbm", "decode_attention", "nvlink", "network")}
    return SystemSpec(name=str(doc.get("system") or Path(where).stem), peak_tflops={"bf16": 1.0, "fp8": 1.0},
                      hbm_gbps=1.0, memory_gib=0.0, nvlink_gbps=1.0, network_gbps=net, efficiency=ones,
                      step_overhead_ms=step.overhead_s * 1e3, kv_memory_fraction=1.0, gpus_per_node=tp,
                      activation_reserve_gib=0.0, sources={"profile": where}, step_profile=doc,
                      chunked_prefill=bool(doc.get("chunked_prefill", False)))
