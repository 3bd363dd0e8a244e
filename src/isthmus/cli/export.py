"""`isthmus export`: a run's model (final, or a checkpoint in any layout) as one safetensors file or an HF folder."""

from __future__ import annotations

import argparse
import sys

from isthmus.cli.common import KEY_HELP, LATEST_RUN


def add_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        allow_abbrev=False,
        help="write a run's model as one .safetensors file that one process loads, or as a Hugging Face folder",
        description="Write a run's model (its final model, else its newest good checkpoint; any layout) as one "
        "safetensors file, with its shape, config and tokenizer in the metadata; or, with --format hf, as a "
        "Hugging Face Llama folder that transformers loads with from_pretrained.",
    )
    export.add_argument(
        "--run", default=LATEST_RUN, help=f"run directory (train.run_dir of the run; default: {LATEST_RUN})"
    )
    export.add_argument(
        "--format",
        choices=("isthmus", "hf"),
        default="isthmus",
        help="isthmus: one FILE.safetensors for isthmus generate / model.init_from (default); "
        "hf: a Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json + tokenizer_config.json; "
        "no tokenizer for raw ids) for transformers' from_pretrained",
    )
    export.add_argument(
        "--out", required=True, help="the file to write, FILE.safetensors (--format hf: a new or empty folder)"
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file (--format hf: an existing model folder, one with config.json); "
        "without it an existing file or a non-empty folder is refused",
    )
    export.add_argument(
        "--checkpoint",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR",
        help="export a checkpoint instead of the final model: the newest good one, or the checkpoint directory DIR",
    )
    export.add_argument(
        "--key-file",
        default="",
        metavar="FILE",
        help=KEY_HELP.format(what="a checkpoint") + "; the exported file is signed with it",
    )


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    # Startup time: torch loads only when the sub-command runs.
    from isthmus.checkpoint.manifest import checkpoint_key
    from isthmus.log import setup_logging
    from isthmus.weights.export import export_run
    from isthmus.weights.hf_export import export_run_hf

    setup_logging()  # a skipped damaged checkpoint is a warning line
    export = export_run_hf if ns.format == "hf" else export_run
    done = export(ns.run, ns.out, ns.checkpoint, checkpoint_key(ns.key_file, "--key-file"), ns.overwrite)
    origin = "final model" if done["origin"] == "final" else f"checkpoint {done['origin']} (step {done['step']})"
    sys.stdout.write(
        f"exported the {origin} of {ns.run}: {done['tensors']} tensors, {done['parameters']:,} parameters, "
        f"{done['bytes'] / 1e6:.1f} MB -> {done['out']}\n"
    )
    if "tokenizer" in done:
        sys.stdout.write(f"  with {done['tokenizer']}\n")
    return 0
