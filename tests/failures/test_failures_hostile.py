"""Files someone else wrote, refused in one line: Hugging Face folders (config.json, safetensors
headers and index), topology files, and an export that would overwrite a file or fill a disk.

Everything runs in this process (the loaders, or `isthmus.cli.main`); only the full disk mounts a
small tmpfs, which needs root.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isthmus.cli import main
from isthmus.cli.train import shipped_configs_dir
from isthmus.config import build_config
from isthmus.data.tokenizer import byte_tokenizer_json
from isthmus.errors import CheckpointError, ConfigError, RunFailed
from isthmus.log import setup_logging
from isthmus.models.args import ModelArgs
from isthmus.models.hf_config import hf_config_from_args
from isthmus.models.pretrained import init_source_args, safetensors_header
from isthmus.planner.topology import load_topology, shipped_topologies_dir
from isthmus.weights.export import ModelSource, export_model
from mounts import tmpfs

TINY = shipped_configs_dir() / "tiny.toml"
ARGS = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=260)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """main() in this process; the logger it points at the captured stderr is detached afterwards."""
    yield capsys
    setup_logging(console=False)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _hf_names(args: ModelArgs) -> dict[str, list[int]]:
    from isthmus.models.llama import build_model
    from isthmus.weights.hf_names import hf_name_map

    shapes = {name: list(t.shape) for name, t in build_model(args).state_dict().items()}
    return {where.name: shapes[ours] for ours, where in hf_name_map(args).items()}


def _safetensors(path: Path, tensors: dict[str, list[int]], end: int | None = None) -> None:
    """A safetensors file of F32 zeros written by hand; ``end`` replaces the last tensor's end offset."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if end is not None:
        header[name]["data_offsets"][1] = end
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def _hf_folder(folder: Path, **config: Any) -> Path:
    """A Llama folder of ARGS's shape, its config.json changed by ``config``."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**hf_config_from_args(ARGS, 64, "float32"), **config}))
    _safetensors(folder / "model.safetensors", _hf_names(ARGS))
    return folder


# --- Hugging Face config.json ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("rms_norm_eps", "abc", "must be a positive number"),
        ("rms_norm_eps", -1.0, "must be a positive number"),
        ("rope_parameters", "x", "must be a JSON object"),
        ("tie_word_embeddings", "yes", "must be true or false"),
        ("hidden_size", 2**40, "must be a positive integer up to"),
        ("num_key_value_heads", 1.5, "must be a positive integer"),
        ("head_dim", "8", "must be a positive integer"),
        ("hidden_act", ["silu"], "isthmus's MLP is SiLU-gated (silu) only"),
    ],
)
def test_a_config_json_field_is_checked_in_one_line(tmp_path: Path, field: str, value: Any, rule: str) -> None:
    folder = _hf_folder(tmp_path / "hf", **{field: value})
    with pytest.raises(CheckpointError) as e:
        init_source_args(str(folder))
    assert str(e.value).startswith(f"{folder / 'config.json'}: {field} = {value!r}: {rule}"), e.value


def test_a_bad_config_json_through_train_and_generate(tmp_path: Path, cli: pytest.CaptureFixture[str]) -> None:
    folder = _hf_folder(tmp_path / "hf", rms_norm_eps="abc")
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())
    line = f"isthmus: error: {folder / 'config.json'}: rms_norm_eps = 'abc': must be a positive number"
    assert main(["train", "--config", "tiny", "--model.init_from", str(folder), "--print-config"]) == 2
    assert _one_line(cli).startswith(line)
    assert main(["generate", "--model", str(folder)]) == 2
    assert _one_line(cli).startswith(line)


def test_more_layers_than_the_weights_hold_names_the_field(tmp_path: Path, cli: pytest.CaptureFixture[str]) -> None:
    folder = _hf_folder(tmp_path / "hf", num_hidden_layers=1000000)
    assert main(["train", "--config", "tiny", "--model.init_from", str(folder), "--print-config"]) == 2
    assert _one_line(cli) == (
        f"isthmus: error: {folder / 'config.json'}: num_hidden_layers = 1000000: "
        f"the weights in {folder} hold 1 layer (model.layers.0)"
    )


def test_a_config_json_shape_the_weights_do_not_have_names_the_field(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "hf", intermediate_size=4096)
    with pytest.raises(CheckpointError) as e:
        init_source_args(str(folder))
    assert str(e.value) == (
        f"{folder / 'config.json'}: intermediate_size = 4096: "
        f"the weights in {folder} have {ARGS.ffn_dim} (model.layers.0.mlp.gate_proj.weight is [32, 16])"
    )


# --- safetensors headers and index ---------------------------------------------------------------
def test_a_safetensors_offset_past_the_file_is_one_line(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "hf")
    weights = folder / "model.safetensors"
    _safetensors(weights, _hf_names(ARGS), end=10**12)
    with pytest.raises(CheckpointError) as e:
        safetensors_header(weights)
    last = list(_hf_names(ARGS))[-1]
    assert str(e.value).startswith(f"{weights}: {last}: data_offsets [") and "run past the end" in str(e.value)


@pytest.mark.parametrize(
    "entry,rule",
    [
        ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}, "shape [2, -1]: must be a list of sizes"),
        ({"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}, "dtype 'X9': unknown"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "holds 8 bytes, and [3] F32 needs 12"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets [8, 0]: must be [begin, end]"),
        ("x", "must be a JSON object"),
    ],
)
def test_a_safetensors_header_entry_is_checked(tmp_path: Path, entry: Any, rule: str) -> None:
    raw = json.dumps({"t": entry}).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(CheckpointError) as e:
        safetensors_header(path)
    assert str(e.value).startswith(f"{path}: t: ") and rule in str(e.value), e.value


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "hf")
    weights = folder / "model.safetensors"
    weights.rename(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": dict.fromkeys(_hf_names(ARGS), "../elsewhere.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        init_source_args(str(folder))
    assert str(e.value) == (
        f"{folder / 'model.safetensors.index.json'}: weight_map names '../elsewhere.safetensors' for "
        "model.embed_tokens.weight: must be a file name inside the folder"
    )


# --- topology files --------------------------------------------------------------------------------
def _topology(tmp_path: Path, old: str, new: str) -> Path:
    text = (shipped_topologies_dir() / "emulated-2dc.toml").read_text()
    assert old in text
    path = tmp_path / "t.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    "old,new,key,value",
    [
        ("bandwidth_gb_s = 0.0025", "bandwidth_gb_s = inf", "topology.wan[0].bandwidth_gb_s", "inf"),
        ("bandwidth_gb_s = 0.0025", "bandwidth_gb_s = nan", "topology.wan[0].bandwidth_gb_s", "nan"),
        ("latency_us = 0 ", "latency_us = inf ", "topology.wan[0].latency_us", "inf"),
        ("latency_us = 0 ", "latency_us = 0\nwindow_kib = nan ", "topology.wan[0].window_kib", "nan"),
        ("memory_gb = 6", "memory_gb = inf", "topology.devices.cpu-core.memory_gb", "inf"),
        ("fp32 = 0.105", "fp32 = -inf", "topology.devices.cpu-core.peak_tflops.fp32", "-inf"),
        ("kernel_launch_us = 20", "kernel_launch_us = 1e400", "topology.devices.cpu-core.kernel_launch_us", "inf"),
        ("nodes = 1", f"nodes = {10**30}", "topology.datacenters[0].nodes", f"{10**30}"),
        ("host_cores = 2", "host_cores = 0", "topology.host_cores", "0"),
    ],
)
def test_a_topology_number_must_be_finite_and_in_range(
    tmp_path: Path, old: str, new: str, key: str, value: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_topology(str(_topology(tmp_path, old, new)))
    assert e.value.key == key and repr(e.value.value) in (value, repr(float(value))), e.value


def test_an_infinite_bandwidth_is_refused_by_plan_simulate_and_emulate(
    tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    path = str(_topology(tmp_path, "bandwidth_gb_s = 0.0025", "bandwidth_gb_s = inf"))
    line = "isthmus: error: topology.wan[0].bandwidth_gb_s = inf: must be a positive finite number"
    for argv in (
        ["plan", "--topology", path, "--model.flavor", "tiny"],
        ["simulate", "--topology", path, "--model.flavor", "tiny"],
        ["emulate", "--topology", path, "--", "train", "--config", "tiny"],
    ):
        assert main(argv) == 2, argv
        assert _one_line(cli) == line, argv


# --- export ----------------------------------------------------------------------------------------
def _source() -> ModelSource:
    from isthmus.models.llama import build_model

    state = build_model(ARGS, device="cpu").state_dict()
    return ModelSource(state, ARGS, {}, "final", None)


def test_export_refuses_an_existing_file_without_overwrite(tmp_path: Path, cli: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "existing.safetensors"
    out.write_bytes(b"keep me")
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert _one_line(cli) == f"isthmus: error: --out {out}: exists; set --overwrite to replace it, or choose another"
    assert out.read_bytes() == b"keep me"


def test_export_with_overwrite_replaces_the_file(tmp_path: Path) -> None:
    out = tmp_path / "existing.safetensors"
    out.write_bytes(b"old")
    export_model(_source(), {"kind": "byte", "vocab_size": 256}, out)
    assert out.stat().st_size > 1000 and not list(tmp_path.glob("*.tmp"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "size=8k") as mnt:
        yield mnt


@pytest.mark.parametrize("form", ["isthmus", "hf"])
def test_export_to_a_full_disk_is_a_run_failure(small_disk: Path, form: str) -> None:
    from isthmus.weights.hf_export import write_hf_folder

    out = small_disk / ("m.safetensors" if form == "isthmus" else "hf")
    with pytest.raises(RunFailed) as e:
        if form == "isthmus":
            export_model(_source(), {"kind": "byte", "vocab_size": 256}, out)
        else:
            write_hf_folder(_source(), out)
    assert e.value.exit_code == 3
    assert str(e.value) == (
        f"no space left on device writing the export {out}; free space there or set --out to another disk"
    )
    assert not list(small_disk.iterdir())


# --- lines that named the wrong thing ---------------------------------------------------------------
def test_many_ranks_are_blamed_on_parallel_nproc(cli: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--config", "tiny", "--parallel.nproc", "512", "--train.batch_size", "512", "--print-config"]
    assert main(argv) == 2
    line = _one_line(cli)
    assert line.startswith("isthmus: error: parallel.nproc = 512: 512 ranks need about "), line
    assert "model.flavor" not in line


def test_a_changed_setting_shows_the_resolved_value_of_a_default(tmp_path: Path) -> None:
    from isthmus.checkpoint.manifest import DCP_METADATA_FILE, Manifest, write_manifest
    from isthmus.launch.rundir import _check_same_settings
    from isthmus.models.resolve import resolve_model_args

    saved = build_config(TINY, [])
    model = resolve_model_args(saved.model, 256).__dict__
    (tmp_path / DCP_METADATA_FILE).write_bytes(b"")
    write_manifest(tmp_path, Manifest(step=2, model=model, layout={}, config=saved.to_toml(), sampler={}, scheduler={}))
    current = build_config(TINY, [("model.dim", "128")])
    with pytest.raises(ConfigError) as e:
        _check_same_settings(tmp_path, current)
    assert "(model.dim: 64 -> 128)" in str(e.value), e.value
    # The flavor's value written out is the same run.
    _check_same_settings(tmp_path, build_config(TINY, [("model.dim", "64")]))
