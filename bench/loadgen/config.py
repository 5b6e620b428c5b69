"""`pdserve bench profile`'s command line: AIPerf's flags (and their aliases) -> ProfileConfig.

The deployment guide's `aiperf profile ...` command runs unchanged with `pdserve bench
profile` in its place. Every flag is listed in `--help` with its default. Bad values stop the
run with a one-line LoadgenError before anything is sent.

Differences from AIPerf, on purpose: `--isl` counts the whole prompt as the server counts it
(chat template and shared prefix included), so it equals `usage.prompt_tokens`; OSL and ISL
are taken from the server's `usage` when it reports one, else counted with the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.loadgen.errors import LoadgenError

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Goodput SLO keys and whether smaller values are better.
GOODPUT_METRICS = {
    "time_to_first_token": True, "time_to_second_token": True, "inter_token_latency": True,
    "time_per_output_token": True, "request_latency": True, "output_token_throughput_per_user": False,
}


@dataclass(frozen=True)
class ProfileConfig:
    model: str
    url: str = "http://localhost:8000"
    endpoint_type: str = "chat"
    endpoint: str | None = None
    tokenizer: str | None = None
    streaming: bool = False
    isl: int = 550
    isl_stddev: float = 0.0
    osl: int | None = None
    osl_stddev: float = 0.0
    num_requests: int | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    arrival: str = "poisson"
    arrival_smoothness: float = 1.0
    benchmark_duration: float | None = None
    grace_period: float = 30.0
    warmup_requests: int = 0
    random_seed: int = 0
    extra_inputs: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    artifact_dir: Path = Path("artifacts/profile")
    ui: str = "simple"
    input_file: Path | None = None
    dataset_type: str | None = None
    fixed_schedule: bool = False
    fixed_schedule_auto_offset: bool = False
    fixed_schedule_start_offset: int | None = None
    fixed_schedule_end_offset: int | None = None
    block_size: int = 512
    num_prefix_prompts: int = 0
    prefix_prompt_length: int = 0
    num_sessions: int | None = None
    session_turns: int = 1
    session_turns_stddev: float = 0.0
    session_turn_delay_ms: float = 0.0
    request_timeout_s: float = 600.0
    workers: int | None = None
    cli_command: str = ""

    @property
    def path(self) -> str:
        return self.endpoint or ENDPOINT_PATHS[self.endpoint_type]

    @property
    def mode(self) -> str:
        if self.input_file is not None and self.fixed_schedule:
            return "fixed_schedule"
        if self.request_rate is not None:
            return "request_rate"
        return "concurrency"


def _kv(text: str, flag: str) -> tuple[str, Any]:
    if ":" not in text:
        raise LoadgenError(f"{flag} {text!r}: expected key:value")
    k, _, v = text.partition(":")
    k = k.strip()
    v = v.strip()
    if not k:
        raise LoadgenError(f"{flag} {text!r}: empty key")
    try:
        return k, json.loads(v)
    except ValueError:
        return k, v


def parse_extra_inputs(items: list[str]) -> dict[str, Any]:
    """`--extra-inputs key:value` (repeatable; values parsed as JSON when they are JSON, so
    `ignore_eos:true` is a boolean) or one JSON object."""
    out: dict[str, Any] = {}
    for item in items:
        item = item.strip()
        if item.startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as e:
                raise LoadgenError(f"--extra-inputs {item!r}: invalid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise LoadgenError(f"--extra-inputs {item!r}: expected a JSON object")
            out.update(obj)
            continue
        k, v = _kv(item, "--extra-inputs")
        out[k] = v
    return out


def parse_goodput(text: str | None) -> dict[str, float]:
    """`--goodput "time_to_first_token:600 inter_token_latency:16.67"`: SLOs in ms (tokens/s
    for output_token_throughput_per_user). Unknown keys are errors, not silently ignored."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        k, v = _kv(part, "--goodput")
        if k not in GOODPUT_METRICS:
            raise LoadgenError(f"--goodput: unknown metric {k!r} (known: {', '.join(GOODPUT_METRICS)})")
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise LoadgenError(f"--goodput {part!r}: {v!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise LoadgenError(f"--goodput {part!r}: the threshold must be a positive number")
        out[k] = value
    return out


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `bench profile` (and of `bench sweep`, which adds its own)."""
    g = p.add_argument_group("endpoint")
    g.add_argument("-m", "--model", "--model-names", dest="model", required=True,
                   help="model name sent in requests; also the default tokenizer")
    g.add_argument("-u", "--url", default="http://localhost:8000", help="server base URL (default: http://localhost:8000)")
    g.add_argument("--endpoint-type", choices=sorted(ENDPOINT_PATHS), default="chat", help="API (default: chat)")
    g.add_argument("--endpoint", "--custom-endpoint", dest="endpoint", default=None,
                   help="path instead of the endpoint type's (default: /v1/chat/completions or /v1/completions)")
    g.add_argument("--streaming", "--stream", dest="streaming", action="store_true",
                   help="stream responses (TTFT, ITL and inter-chunk latency need it)")
    g.add_argument("--extra-inputs", action="append", default=[], metavar="KEY:VALUE",
                   help="extra request body field, repeatable (e.g. ignore_eos:true, or one JSON object)")
    g.add_argument("-H", "--header", action="append", default=[], metavar="NAME:VALUE", help="extra HTTP header, repeatable")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout-seconds", type=float, default=600.0, help="per-request timeout (default: 600)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer (local dir, embedded name or hub id; default: that of -m). "
                        "A run whose tokenizer cannot load stops")

    g = p.add_argument_group("prompts")
    g.add_argument("--isl", "--synthetic-input-tokens-mean", "--prompt-input-tokens-mean", dest="isl", type=int,
                   default=550, help="prompt tokens as the server counts them, template included (default: 550)")
    g.add_argument("--isl-stddev", "--synthetic-input-tokens-stddev", "--prompt-input-tokens-stddev",
                   dest="isl_stddev", type=float, default=0.0, help="stddev of the prompt length (default: 0)")
    g.add_argument("--osl", "--output-tokens-mean", "--prompt-output-tokens-mean", dest="osl", type=int, default=None,
                   help="output tokens requested (max_tokens; add ignore_eos:true to force them; default: server's)")
    g.add_argument("--osl-stddev", "--output-tokens-stddev", "--prompt-output-tokens-stddev", dest="osl_stddev",
                   type=float, default=0.0, help="stddev of the output length (default: 0)")
    g.add_argument("--num-prefix-prompts", "--prefix-prompt-pool-size", "--prompt-prefix-pool-size",
                   dest="num_prefix_prompts", type=int, default=0,
                   help="distinct shared prefixes; each prompt starts with one at random (default: 0, none)")
    g.add_argument("--prefix-prompt-length", "--prompt-prefix-length", dest="prefix_prompt_length", type=int,
                   default=0, help="tokens of each shared prefix, counted inside --isl (default: 0)")
    g.add_argument("--conversation-num", "--num-conversations", "--num-sessions", dest="num_sessions", type=int,
                   default=None, help="multi-turn sessions (default: one per request)")
    g.add_argument("--conversation-turn-mean", "--session-turns-mean", dest="session_turns", type=int, default=1,
                   help="turns per session; each turn sends the history so far (default: 1)")
    g.add_argument("--conversation-turn-stddev", "--session-turns-stddev", dest="session_turns_stddev", type=float,
                   default=0.0, help="stddev of turns per session (default: 0)")
    g.add_argument("--conversation-turn-delay-mean", "--session-turn-delay-mean", dest="session_turn_delay_ms",
                   type=float, default=0.0, help="ms between a reply and the session's next turn (default: 0)")
    g.add_argument("--input-file", default=None,
                   help="Mooncake trace JSONL (timestamp, input_length, output_length, hash_ids)")
    g.add_argument("--custom-dataset-type", dest="dataset_type", default=None, choices=["mooncake_trace"],
                   help="format of --input-file (default: mooncake_trace)")
    g.add_argument("--isl-block-size", "--prompt-input-tokens-block-size", "--synthetic-input-tokens-block-size",
                   dest="block_size", type=int, default=512, help="tokens per trace hash id (default: 512)")
    g.add_argument("--random-seed", type=int, default=0, help="seed for prompts, lengths and arrivals (default: 0)")

    g = p.add_argument_group("load")
    g.add_argument("--num-requests", "--request-count", dest="num_requests", type=int, default=None,
                   help="requests to measure (default: 10, or the trace's length, or unbounded with --benchmark-duration)")
    g.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight; with --request-rate, a cap (default: 1 without a rate)")
    g.add_argument("--request-rate", type=float, default=None, help="requests per second (default: none, closed loop)")
    g.add_argument("--arrival", "--arrival-pattern", dest="arrival", choices=["constant", "poisson", "gamma"],
                   default="poisson", help="inter-arrival times with --request-rate (default: poisson)")
    g.add_argument("--arrival-smoothness", type=float, default=1.0,
                   help="gamma shape for --arrival gamma: 1 is poisson, larger is smoother (default: 1)")
    g.add_argument("--benchmark-duration", type=float, default=None, help="stop sending after this many seconds")
    g.add_argument("--benchmark-grace-period", dest="grace_period", type=float, default=30.0,
                   help="seconds in-flight requests may finish after --benchmark-duration (default: 30)")
    g.add_argument("--num-warmup-requests", "--warmup-request-count", dest="warmup_requests", type=int, default=0,
                   help="requests sent first and left out of the results (default: 0)")
    g.add_argument("--fixed-schedule", action="store_true", help="send trace requests at their timestamps")
    g.add_argument("--fixed-schedule-auto-offset", action="store_true",
                   help="shift the schedule so the first trace timestamp is time 0")
    g.add_argument("--fixed-schedule-start-offset", type=int, default=None, help="skip trace entries before this ms")
    g.add_argument("--fixed-schedule-end-offset", type=int, default=None, help="skip trace entries after this ms")
    g.add_argument("--workers-max", "--max-workers", dest="workers", type=int, default=None,
                   help="client processes (default: one per 300 req/s or 256 in flight, at most the CPU count)")

    g = p.add_argument_group("output")
    g.add_argument("--goodput", default=None, metavar="'METRIC:VALUE ...'",
                   help="SLOs for goodput, e.g. 'time_to_first_token:600 inter_token_latency:16.67' (ms)")
    g.add_argument("--artifact-dir", "--output-artifact-dir", dest="artifact_dir", default=None,
                   help="where results go (default: artifacts/<model>-<endpoint>-<load>)")
    g.add_argument("--ui-type", "--ui", dest="ui", choices=["simple", "none", "dashboard"], default="simple",
                   help="progress display; dashboard is shown as simple (default: simple)")


def _default_artifact_dir(args: argparse.Namespace) -> Path:
    model = args.model.strip("/").replace("/", "_")
    load = (f"request_rate{args.request_rate:g}" if args.request_rate is not None
            else f"concurrency{args.concurrency or 1}")
    return Path("artifacts") / f"{model}-{args.endpoint_type}-{load}"


def _headers(items: list[str], api_key: str | None) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition(":")
        if not sep or not k.strip():
            raise LoadgenError(f"--header {item!r}: expected NAME:VALUE")
        out[k.strip()] = v.strip()
    # pdserve's frontend then reports each request's TTFT by stage (other servers ignore it).
    if not any(k.lower() == "x-pdserve-timing" for k in out):
        out["X-PDSERVE-Timing"] = "1"
    if api_key:
        out.setdefault("Authorization", f"Bearer {api_key}")
    return out


def config_from_args(args: argparse.Namespace, cli_command: str = "") -> ProfileConfig:
    """Validate the parsed flags; every problem is one LoadgenError line."""
    parts = urlsplit(args.url if "://" in args.url else "http://" + args.url)
    if parts.scheme != "http":
        raise LoadgenError(f"-u {args.url}: only http:// URLs are supported")
    if not parts.hostname:
        raise LoadgenError(f"-u {args.url}: no host")

    def positive(name: str, value: float | None, allow_zero: bool = False) -> None:
        if value is None:
            return
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise LoadgenError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")

    positive("--isl", args.isl)
    positive("--osl", args.osl)
    positive("--isl-stddev", args.isl_stddev, True)
    positive("--osl-stddev", args.osl_stddev, True)
    positive("--num-requests", args.num_requests)
    positive("--concurrency", args.concurrency)
    positive("--request-rate", args.request_rate)
    positive("--arrival-smoothness", args.arrival_smoothness)
    positive("--benchmark-duration", args.benchmark_duration)
    positive("--benchmark-grace-period", args.grace_period, True)
    positive("--num-warmup-requests", args.warmup_requests, True)
    positive("--request-timeout-seconds", args.request_timeout_seconds)
    positive("--workers-max", args.workers)
    positive("--num-prefix-prompts", args.num_prefix_prompts, True)
    positive("--prefix-prompt-length", args.prefix_prompt_length, True)
    positive("--conversation-num", args.num_sessions)
    positive("--conversation-turn-mean", args.session_turns)
    positive("--conversation-turn-delay-mean", args.session_turn_delay_ms, True)
    positive("--isl-block-size", args.block_size)
    if bool(args.num_prefix_prompts) != bool(args.prefix_prompt_length):
        raise LoadgenError("--num-prefix-prompts and --prefix-prompt-length go together")
    if args.session_turns > 1 and args.endpoint_type != "chat":
        raise LoadgenError("multi-turn sessions (--conversation-turn-mean > 1) need --endpoint-type chat")
    input_file = Path(args.input_file) if args.input_file else None
    if input_file is not None and not input_file.is_file():
        raise LoadgenError(f"--input-file {args.input_file}: no such file")
    if args.fixed_schedule and input_file is None:
        raise LoadgenError("--fixed-schedule replays an --input-file trace; none given")
    if args.dataset_type and input_file is None:
        raise LoadgenError("--custom-dataset-type needs --input-file")
    if input_file is not None and args.session_turns > 1:
        raise LoadgenError("--input-file traces are single-turn; drop --conversation-turn-mean")
    return ProfileConfig(
        model=args.model, url=f"http://{parts.hostname}:{parts.port or 80}{parts.path.rstrip('/')}",
        endpoint_type=args.endpoint_type, endpoint=args.endpoint, tokenizer=args.tokenizer,
        streaming=args.streaming, isl=args.isl, isl_stddev=args.isl_stddev, osl=args.osl,
        osl_stddev=args.osl_stddev, num_requests=args.num_requests, concurrency=args.concurrency,
        request_rate=args.request_rate, arrival=args.arrival, arrival_smoothness=args.arrival_smoothness,
        benchmark_duration=args.benchmark_duration, grace_period=args.grace_period,
        warmup_requests=args.warmup_requests, random_seed=args.random_seed,
        extra_inputs=parse_extra_inputs(args.extra_inputs), headers=_headers(args.header, args.api_key),
        goodput=parse_goodput(args.goodput),
        artifact_dir=Path(args.artifact_dir) if args.artifact_dir else _default_artifact_dir(args),
        ui="simple" if args.ui == "dashboard" else args.ui, input_file=input_file,
        dataset_type=args.dataset_type or ("mooncake_trace" if input_file else None),
        fixed_schedule=args.fixed_schedule, fixed_schedule_auto_offset=args.fixed_schedule_auto_offset,
        fixed_schedule_start_offset=args.fixed_schedule_start_offset,
        fixed_schedule_end_offset=args.fixed_schedule_end_offset, block_size=args.block_size,
        num_prefix_prompts=args.num_prefix_prompts, prefix_prompt_length=args.prefix_prompt_length,
        num_sessions=args.num_sessions, session_turns=args.session_turns,
        session_turns_stddev=args.session_turns_stddev, session_turn_delay_ms=args.session_turn_delay_ms,
        request_timeout_s=args.request_timeout_seconds, workers=args.workers, cli_command=cli_command,
    )
