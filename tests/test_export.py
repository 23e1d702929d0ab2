"""Back to Hugging Face: ``export_pretrained`` / ``lightning-zero export`` (lightning_zero/checkpoints/export.py).

The round trip: a tiny GPT-2 (tied embeddings) and a tiny Llama held by a LightningModule as ``self.lm``, fitted under
``ddp`` and ``zero3`` on 2 ranks (tests/workers/export.py); zero3's sharded checkpoint, and its consolidated file,
exported in several shards, load with ``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected key and
give the ``ddp``-trained model's logits. The rest runs in this process on files built here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero import consolidate, export_pretrained
from lightning_zero.checkpoints import export
from lightning_zero.checkpoints.errors import CheckpointError
from lightning_zero.testing.launch import ROOT, launch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHARD = "20kB"  # the tiny models are about 140 kB: several shards


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("export")
    ranks = launch("export.py", 2, out, timeout=300)
    return out, ranks[0]


def logits_of(directory: Path) -> torch.Tensor:
    from tests.workers.export import FIXED_INPUT

    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with torch.no_grad():
        return model.eval()(FIXED_INPUT).logits


def check_shards(directory: Path, max_bytes: int) -> dict[str, str]:
    """The weight map, after checking the files are named and sized as transformers writes them."""
    index = json.loads((directory / export.INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == export.shard_file_names(len(files))
    assert sorted(p.name for p in directory.glob("*.safetensors")) == files
    total = 0
    for file in files:
        tensors = safetensors_torch.load_file(directory / file)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= max_bytes or len(tensors) == 1, file
        assert {k for k, f in index["weight_map"].items() if f == file} == set(tensors)
        total += size
    assert index["metadata"]["total_size"] == total
    return index["weight_map"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("source", ["directory", "consolidated file"])
def test_zero3_checkpoint_exports_to_the_ddp_trained_model(trained, tmp_path, name, source):
    out, reference = trained
    checkpoint = out / f"{name}-zero3.ckpt"
    if source == "consolidated file":
        checkpoint = consolidate(checkpoint, tmp_path / f"{name}.ckpt", weights_only=True)
    result = export_pretrained(checkpoint, tmp_path / "hf", max_shard_size=SHARD)
    assert result.submodule == "lm" and result.config_written
    weight_map = check_shards(tmp_path / "hf", 20_000)
    assert not any(k.startswith("lm.") for k in weight_map)
    if name == "gpt2":  # tied: written once, under the embedding's name (as save_pretrained)
        assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map
    else:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= weight_map.keys()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[name]]
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    logits = logits_of(tmp_path / "hf")
    torch.testing.assert_close(logits, reference["logits"][name], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits, reference["initial"][name], atol=1e-3)  # trained weights, not initial ones


@pytest.mark.timeout(400)
def test_the_command_exports_without_the_users_code(trained, tmp_path):
    """The LightningModule lived in the ranks' ``__main__``: the command imports nothing of it."""
    out, reference = trained
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "lightning_zero", "export", str(out / "gpt2-zero3.ckpt"),
                           str(tmp_path / "hf"), "--max-shard-size", "40KB"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "wrote the attribute 'lm'" in done.stdout
    check_shards(tmp_path / "hf", 40_000)
    torch.testing.assert_close(logits_of(tmp_path / "hf"), reference["logits"]["gpt2"], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
def test_export_holds_one_shard_at_a_time(trained, tmp_path, monkeypatch):
    """Each shard's tensors are read when it is written, and gone before the next shard is read."""
    out, _ = trained
    reads: list[list[str]] = []
    alive: list[weakref.ref] = []
    original = export._directory_source

    def watched(path: Path) -> export._Source:
        source = original(path)
        read = source.read

        def read_one_shard(names: list[str]) -> dict[str, torch.Tensor]:
            assert all(ref() is None for ref in alive), "a tensor of the previous shard is still held"
            reads.append(names)
            tensors = read(names)
            alive.extend(weakref.ref(t) for t in tensors.values())
            return tensors

        source.read = read_one_shard
        return source

    monkeypatch.setattr(export, "_directory_source", watched)
    result = export_pretrained(out / "llama-zero3.ckpt", tmp_path / "hf", max_shard_size=SHARD)
    assert len(reads) == len(result.files) > 2
    assert sorted(n for names in reads for n in names) == sorted(f"lm.{k}" for k in check_shards(tmp_path / "hf",
                                                                                                  20_000))


# ---------------------------------------------------------------------- in process
def tiny_gpt2(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=16, bos_token_id=0, eos_token_id=0))


class TwoModels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = tiny_gpt2(1), tiny_gpt2(2)
        self.head = nn.Linear(4, 4)  # not pretrained: never exported


def save_file(module: nn.Module, path: Path) -> Path:
    """A file in ``ddp``'s form with the configs recorded, as ``consolidate`` writes it."""
    torch.save({"state_dict": module.state_dict(), "lightning_zero": {"pretrained": export.pretrained_configs(module)}},
               path)
    return path


def test_several_pretrained_models_need_a_submodule(tmp_path):
    module = TwoModels()
    assert set(export.pretrained_configs(module)) == {"student", "teacher"}  # the outermost ones only
    path = save_file(module, tmp_path / "two.ckpt")
    with pytest.raises(CheckpointError, match="holds 2 pretrained models.*--submodule"):
        export_pretrained(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before writing
    result = export_pretrained(path, tmp_path / "hf", submodule="teacher", dtype=torch.bfloat16)
    assert result.files == ["model.safetensors"] and not (tmp_path / "hf" / export.INDEX_NAME).exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for key, value in module.teacher.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key
    with pytest.raises(CheckpointError, match="no weights under 'nothing'.*'head', 'student', 'teacher'"):
        export_pretrained(path, tmp_path / "hf", submodule="nothing", config=tmp_path / "hf")


def test_a_plain_model_exports_weights_alone_and_the_command_asks_for_a_config(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 300))
    model[1].weight = model[0].weight  # tied
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, path)
    with pytest.raises(CheckpointError, match="records no transformers config.*--config DIR_OR_NAME"):
        export_pretrained(path, tmp_path / "hf", require_config=True)
    result = export_pretrained(path, tmp_path / "hf", max_shard_size="10KiB")
    assert not result.config_written and result.submodule == ""
    weight_map = json.loads((tmp_path / "hf" / export.INDEX_NAME).read_text())["weight_map"]
    assert sorted(weight_map) == ["0.weight", "1.bias"]  # the tied weight once, under its first name
    loaded = {k: v for f in set(weight_map.values()) for k, v in safetensors_torch.load_file(tmp_path / "hf" / f).items()}
    assert torch.equal(loaded["0.weight"], model[0].weight) and torch.equal(loaded["1.bias"], model[1].bias)
    assert not (tmp_path / "hf" / "config.json").exists()


def test_a_config_passed_by_directory_is_written(tmp_path):
    model = tiny_gpt2(3)
    model.config.save_pretrained(tmp_path / "config")
    path = tmp_path / "m.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in model.state_dict().items()}}, path)
    export_pretrained(path, tmp_path / "hf", submodule="net", config=tmp_path / "config", require_config=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_second_export_into_the_directory_leaves_no_stale_shards(tmp_path):
    path = save_file(tiny_gpt2(4), tmp_path / "m.ckpt")
    export_pretrained(path, tmp_path / "hf", max_shard_size="4kB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    export_pretrained(path, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "hf" / export.INDEX_NAME).exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_exported_file_gets_the_mode_the_umask_gives(tmp_path, umask):
    path = save_file(tiny_gpt2(4), tmp_path / "m.ckpt")
    previous = os.umask(umask)
    try:
        export_pretrained(path, tmp_path / "hf", max_shard_size="4kB")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "config.json" in modes and sum(name.endswith(".safetensors") for name in modes) > 2
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def safetensors_data_bytes(file: Path) -> int:
    """The bytes of tensor data in a safetensors file, read from the file itself (its size less the 8-byte length
    and the JSON header it announces)."""
    with open(file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return file.stat().st_size - 8 - header


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_converting_export_sizes_and_cuts_its_shards_by_the_bytes_it_writes(tmp_path, dtype):
    """``dtype=`` converts the fp32 weights: the index's ``total_size`` is the tensor bytes in the files written, and
    the files, their tensors and the index are those transformers' own ``save_pretrained`` writes for the model in
    that dtype with the same ``max_shard_size``."""
    model = tiny_gpt2(5)
    path = save_file(model, tmp_path / "m.ckpt")
    result = export_pretrained(path, tmp_path / "hf", max_shard_size="3kB", dtype=dtype)
    model.to(dtype).save_pretrained(tmp_path / "reference", max_shard_size="3kB")
    ours, theirs = (sorted((tmp_path / d).glob("*.safetensors")) for d in ("hf", "reference"))
    assert len(ours) > 2 and [f.name for f in ours] == [f.name for f in theirs]
    for mine, reference in zip(ours, theirs):
        written, expected = safetensors_torch.load_file(mine), safetensors_torch.load_file(reference)
        assert written.keys() == expected.keys(), mine.name
        assert all(torch.equal(written[k], v) and written[k].dtype == dtype for k, v in expected.items()), mine.name
    index, reference_index = (json.loads((tmp_path / d / export.INDEX_NAME).read_text()) for d in ("hf", "reference"))
    on_disk = sum(safetensors_data_bytes(f) for f in ours)
    assert index["metadata"]["total_size"] == on_disk == result.total_size == reference_index["metadata"]["total_size"]
    assert index["weight_map"] == reference_index["weight_map"]


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("200MB", 200 * 10**6),
                                        ("64KiB", 64 * 2**10), (1234, 1234), ("1.5kB", 1500)])
def test_shard_sizes_read_as_hugging_face_reads_them(text, size):
    assert export.parse_shard_size(text) == size


@pytest.mark.parametrize("text", ["5", "GB", "-1GB", "five GB", 0])
def test_a_size_without_a_unit_is_refused(text):
    with pytest.raises(ValueError, match="is not a size"):
        export.parse_shard_size(text)


def test_shards_are_cut_as_huggingface_hub_cuts_them():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 3, "e": 5}
    # (the shard of a tensor over the limit comes before the one being filled, as in huggingface_hub)
    assert export.plan_shards(sizes, 8) == [["c"], ["a", "b"], ["d", "e"]]
    assert export.shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
