"""`isthmus export --format hf`: a run's model as a folder transformers loads with ``from_pretrained``.

The folder holds ``config.json``, ``generation_config.json`` (the sampling defaults of `isthmus
generate`) and ``model.safetensors`` under HF names, with wq/wk rows in HF's rotary layout and each
MoE layer's experts one tensor apiece (`isthmus.weights.hf_names`). The architecture follows the
model (`hf_arch_for`): ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` with q/k norms, and for MoE models
``MixtralForCausalLM``, or ``Qwen3MoeForCausalLM`` with q/k norms. Tensors keep their dtype, so a
model imported from an HF folder and exported untrained is the same bytes.

Tokenizer files, by the run's tokenizer (`tokenizer_files`): a checkpoint's (``hf:PATH``) goes back
as the run kept it, ``tokenizer.json`` with ``tokenizer_config.json`` / ``special_tokens_map.json``
when it had them, and BOS/EOS ids in config.json; a locally trained BPE as its ``tokenizer.json``;
the byte tokenizer as a byte-level BPE without merges (id = byte value); raw ids (a .bin file of
unknown origin) write none, and the export says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from isthmus.data.tokenizer import BPE_FILE, META_FILE, PretrainedTokenizer, byte_tokenizer_json, load_tokenizer
from isthmus.errors import IsthmusError
from isthmus.models.hf_config import HF_CONFIG_FILE, hf_arch_for, hf_config_from_args
from isthmus.weights.export import ModelSource, export_summary, find_source, write_failed
from isthmus.weights.hf_names import hf_state_dict, hf_zero_names

WEIGHTS_FILE = "model.safetensors"
GENERATION_FILE = "generation_config.json"
DEFAULT_SEQ_LEN = 2048
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _seq_len(config: dict[str, Any]) -> int:
    seq_len = config.get("train", {}).get("seq_len")
    return int(seq_len) if isinstance(seq_len, int) else DEFAULT_SEQ_LEN


TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers' generic class for a bare tokenizer.json (TokenizersBackend in transformers 5).
FAST_CLASS = "PreTrainedTokenizerFast"


def tokenizer_files(run: Path | None) -> tuple[dict[str, str], dict[str, int], str]:
    """The tokenizer files an export of ``run`` holds (name -> text), its BOS/EOS ids, and a note
    saying what was written."""
    if run is None or not (run / META_FILE).is_file():
        return {}, {}, "no tokenizer files (the run has no tokenizer)"
    tokenizer = load_tokenizer(run)
    if tokenizer.kind not in ("hf", "bpe", "byte"):
        return {}, {}, f"no tokenizer files (the {tokenizer.kind} tokenizer's ids have no known text)"
    if tokenizer.kind == "byte":
        files = {BPE_FILE: byte_tokenizer_json()}
    else:
        files = {BPE_FILE: (run / BPE_FILE).read_text(encoding="utf-8")}
    specials: dict[str, int] = {}
    config: dict[str, Any] = {"tokenizer_class": FAST_CLASS}
    if isinstance(tokenizer, PretrainedTokenizer):
        files.update(tokenizer.side_files)
        for role, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
            if i is not None:
                specials[f"{role}_token_id"] = i
                config[f"{role}_token"] = tokenizer.token(i)
    if TOKENIZER_CONFIG not in files:
        # Without it transformers picks the class from config.json (a Llama tokenizer that builds its
        # own pipeline); the generic class uses tokenizer.json as it is.
        files[TOKENIZER_CONFIG] = json.dumps(config, indent=2) + "\n"
    what = (
        "byte tokenizer: a byte-level BPE without merges, id = byte"
        if tokenizer.kind == "byte"
        else f"{tokenizer.kind} tokenizer"
    )
    return files, specials, f"tokenizer files {', '.join(sorted(files))} ({what})"


def write_hf_folder(source: ModelSource, out: Path, run: Path | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write ``source`` as an HF model folder ``out`` (built aside, then renamed), with the tokenizer
    files of the run ``run`` (see `tokenizer_files`); returns a summary. With ``overwrite`` an existing
    model folder (one with a config.json) is replaced; any other non-empty folder, or a file, never is."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (overwrite and (out / HF_CONFIG_FILE).is_file()):
            hint = "; --overwrite replaces only a model folder (one with config.json)" if overwrite else ""
            raise IsthmusError(f"--out {out}: exists and is not an empty folder{hint}")
    if not out.parent.is_dir():
        raise IsthmusError(f"--out {out}: no such directory {out.parent}")
    hf_arch_for(source.args)  # refuses a model no architecture computes
    for name in hf_zero_names(source.args):
        if source.state[name].any():
            raise IsthmusError(f"--format hf: {name} is not zero, and HF's routers have no expert bias")
    dtype = _DTYPE_NAMES.get(source.state["tok_embeddings.weight"].dtype, "float32")
    config = hf_config_from_args(source.args, _seq_len(source.config), dtype)
    tensors = hf_state_dict(source.state, source.args)
    tok_files, specials, tok_note = tokenizer_files(run)
    config.update(specials)
    generation = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_length": config["max_position_embeddings"]}
    generation.update(specials)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, text in tok_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)  # empty, or a model folder --overwrite replaces (checked above)
        tmp.replace(out)
    except Exception as e:  # OSError, or safetensors' own error for a failed write
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(out, e) from None
    return {**export_summary(out, source, tensors, out / WEIGHTS_FILE), "tokenizer": tok_note}


def export_run_hf(
    run: str | Path,
    out: str | Path,
    checkpoint: str | None = None,
    key: bytes | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """`isthmus export --format hf`: the weights of ``run`` (see `find_source`) as an HF folder ``out``.

    Given ``key``, a checkpoint exported must be signed with it (the folder itself is not signed)."""
    return write_hf_folder(find_source(Path(run), checkpoint, key), Path(out), Path(run), overwrite)
