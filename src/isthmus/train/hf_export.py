"""`isthmus export --format hf`: a run's model as a folder transformers loads with ``from_pretrained``.

The folder holds ``config.json`` (``LlamaForCausalLM``), ``generation_config.json`` (the sampling
defaults of `isthmus generate`) and ``model.safetensors`` under HF names, with wq/wk rows in HF's
rotary layout (`isthmus.models.hf`). Tensors keep their dtype, so a model imported from an HF
folder and exported untrained is the same bytes. The tokenizer is not written yet: isthmus's byte
tokenizer has no ``tokenizer.json`` counterpart in this version.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from isthmus.errors import IsthmusError
from isthmus.models.hf import hf_state_dict
from isthmus.models.hf_config import HF_CONFIG_FILE, hf_config_from_args
from isthmus.train.export import ModelSource, export_summary, find_source, write_failed

WEIGHTS_FILE = "model.safetensors"
GENERATION_FILE = "generation_config.json"
DEFAULT_SEQ_LEN = 2048
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _seq_len(config: dict[str, Any]) -> int:
    seq_len = config.get("train", {}).get("seq_len")
    return int(seq_len) if isinstance(seq_len, int) else DEFAULT_SEQ_LEN


def write_hf_folder(source: ModelSource, out: Path) -> dict[str, Any]:
    """Write ``source`` as an HF Llama folder ``out`` (built aside, then renamed); returns a summary."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise IsthmusError(f"--out {out}: exists and is not an empty folder")
    if not out.parent.is_dir():
        raise IsthmusError(f"--out {out}: no such directory {out.parent}")
    if source.args.mlp != "swiglu":
        raise IsthmusError(f"--format hf: the model has model.mlp = {source.args.mlp!r}; a LlamaForCausalLM is swiglu")
    dtype = _DTYPE_NAMES.get(source.state["tok_embeddings.weight"].dtype, "float32")
    config = hf_config_from_args(source.args, _seq_len(source.config), dtype)
    tensors = hf_state_dict(source.state, source.args)
    generation = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_length": config["max_position_embeddings"]}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.replace(out)
    except Exception as e:  # OSError, or safetensors' own error for a failed write
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(out, e) from None
    return export_summary(out, source, tensors, out / WEIGHTS_FILE)


def export_run_hf(
    run: str | Path, out: str | Path, checkpoint: str | None = None, key: bytes | None = None
) -> dict[str, Any]:
    """`isthmus export --format hf`: the weights of ``run`` (see `find_source`) as an HF folder ``out``.

    Given ``key``, a checkpoint exported must be signed with it (the folder itself is not signed)."""
    return write_hf_folder(find_source(Path(run), checkpoint, key), Path(out))
