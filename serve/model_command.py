"""`pdserve model prepare|path|download|wait`."""

from __future__ import annotations

import argparse

from serve.errors import PdserveError


def add_arguments(m: argparse.ArgumentParser) -> None:
    msub = m.add_subparsers(dest="model_command", metavar="ACTION")
    mp = msub.add_parser("prepare", help="convert the embedded model into a Hugging Face directory (once)")
    mp.add_argument("--force", action="store_true", help="convert again even if present")
    msub.add_parser("path", help="print the embedded model's directory")
    md = msub.add_parser("download", help="download a hub model into the Hugging Face cache (HF_HOME) once; "
                                          "the Kubernetes model-cache Job")
    md.add_argument("model", help="hub id, e.g. nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1, or the embedded model's name")
    md.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    mw = msub.add_parser("wait", help="wait until a model is in the local cache (a Kubernetes init container)")
    mw.add_argument("model", help="hub id, local directory, or the embedded model's name")
    mw.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait (default: 3600)")


def run(args: argparse.Namespace) -> int:
    from serve import model

    if args.model_command == "prepare":
        print(model.prepare_embedded_model(force=args.force))
        return 0
    if args.model_command == "path":
        print(model.embedded_model_dir())
        return 0
    if args.model_command == "download":
        print(model.download_model(args.model, args.revision))
        return 0
    if args.model_command == "wait":
        if args.timeout < 0:
            raise PdserveError("--timeout must be >= 0")
        model.wait_for_model(args.model, args.timeout)
        print(f"{args.model}: present")
        return 0
    raise PdserveError("usage: pdserve model prepare|path|download|wait")
