"""``load_pretrained``: names and shapes checked before anything is loaded, every file format, and the zero stages.

The single-process tests load into plain modules; two launches of 2 gloo ranks (``workers/pretrained.py``) fill zero3
models (in ``configure_model``, and after setup), zero1 and zero2, compare their logits with the Hugging Face model
loaded by ``from_pretrained``, and measure each rank's peak host memory during the load.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import load_pretrained
from lightning_zero.pretrained import files as pretrained_files
from lightning_zero.pretrained.loading import _PENDING, deferring
from lightning_zero.testing.launch import launch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
warnings.filterwarnings("ignore", message=".*token_id.*")


def tiny_gpt2(seed: int = 0, **overrides: int) -> "transformers.GPT2LMHeadModel":
    config = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    config.update(overrides)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))


def assert_same_weights(model: nn.Module, reference: nn.Module) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key].to(ours[key].dtype), rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same tiny GPT-2 saved as one safetensors file, as sharded safetensors, and as torch state dicts."""
    root = tmp_path_factory.mktemp("pretrained")
    model = tiny_gpt2(seed=1)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    (root / "bin").mkdir()
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    torch.save(model.state_dict(), root / "weights.pt")
    return root, model


@pytest.mark.parametrize("where", ["single", "sharded", "bin", "weights.pt", "single/model.safetensors",
                                   "sharded/model.safetensors.index.json"])
def test_every_format_loads_into_a_plain_module_with_the_tied_head(saved, where):
    root, reference = saved
    model = tiny_gpt2(seed=2)
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    result = load_pretrained(model, root / where)
    assert result == lightning_zero.LoadResult([], [])
    assert_same_weights(model, reference)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_prefix_maps_the_file_names_into_a_wrapper_and_leaves_its_other_weights(saved):
    root, reference = saved

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_gpt2(seed=2)
            self.head = nn.Linear(32, 3)

    wrapper = Wrapper()
    head = wrapper.head.weight.detach().clone()
    load_pretrained(wrapper, root / "single", prefix="lm.")
    assert_same_weights(wrapper.lm, reference)
    assert torch.equal(wrapper.head.weight, head)


def test_a_shape_mismatch_names_the_key_and_both_shapes_and_loads_nothing(saved):
    root, _ = saved
    model = tiny_gpt2(seed=2, vocab_size=65)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_pretrained(model, root / "sharded", strict=False)  # shapes must match even when not strict
    assert "transformer.wte.weight: [64, 32] in the file, [65, 32] in the model" in str(error.value)
    assert "nothing was loaded" in str(error.value)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_missing_and_unexpected_keys_are_listed_and_strict_false_returns_them(tmp_path, saved):
    root, reference = saved
    state = dict(reference.state_dict())
    del state["transformer.ln_f.bias"]
    state["transformer.extra"] = torch.zeros(3)
    del state["lm_head.weight"]
    torch.save(state, tmp_path / "partial.pt")
    model = tiny_gpt2(seed=2)
    with pytest.raises(ValueError) as error:
        load_pretrained(model, tmp_path / "partial.pt")
    message = str(error.value)
    assert "Missing in the files (module keys no file tensor fills), 1:\n    transformer.ln_f.bias" in message
    assert "Unexpected in the files (no such module key), 1:\n    transformer.extra" in message
    assert "lm_head.weight" not in message  # tied to transformer.wte.weight, which is in the file
    assert not torch.equal(model.transformer.wte.weight, reference.transformer.wte.weight)
    result = load_pretrained(model, tmp_path / "partial.pt", strict=False)
    assert result == lightning_zero.LoadResult(["transformer.ln_f.bias"], ["transformer.extra"])
    torch.testing.assert_close(model.transformer.wte.weight, reference.transformer.wte.weight)


def test_a_missing_prefix_is_suggested(saved):
    root, _ = saved
    wrapper = nn.Module()
    wrapper.lm = tiny_gpt2()
    with pytest.raises(ValueError, match=r"Did you mean `prefix='lm\.'`"):
        load_pretrained(wrapper, root / "single")


def test_buffers_load_and_dtypes_convert_to_the_model(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    source[1].running_mean.normal_()
    source[1].num_batches_tracked.fill_(7)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in source.state_dict().items()},
              tmp_path / "bf16.safetensors")
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double()
    load_pretrained(model, tmp_path / "bf16.safetensors")
    for key, value in source.state_dict().items():
        expected = value.to(torch.bfloat16).to(model.state_dict()[key].dtype) if value.is_floating_point() else value
        assert torch.equal(model.state_dict()[key], expected), key
    assert model[0].weight.dtype == torch.float64 and int(model[1].num_batches_tracked) == 7


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_ranges_are_read_in_blocks_smaller_than_a_row_or_a_tensor(tmp_path, monkeypatch, fmt):
    from safetensors.torch import save_file

    tensors = {"m": torch.randn(37, 11), "v": torch.randn(100), "s": torch.tensor(3.5), "c": torch.randn(5, 3, 2)}
    path = tmp_path / ("w.safetensors" if fmt == "safetensors" else "w.pt")
    save_file(tensors, path) if fmt == "safetensors" else torch.save(tensors, path)
    files = pretrained_files.WeightFiles(path)
    assert {k: i.shape for k, i in files.tensors.items()} == {k: tuple(t.shape) for k, t in tensors.items()}
    reads = []
    original = pretrained_files._rows
    monkeypatch.setattr(pretrained_files, "_rows", lambda *a: reads.append(a[2]) or original(*a))
    monkeypatch.setattr(pretrained_files, "READ_BLOCK_BYTES", 3 * 11 * 4)  # three rows of "m"
    for name, start, length in [("m", 0, 407), ("m", 5, 30), ("m", 40, 200), ("v", 17, 50), ("s", 0, 1),
                                ("c", 4, 21)]:
        reads.clear()
        dest = torch.empty(length, dtype=torch.float64)
        files.copy_range(name, start, dest)
        torch.testing.assert_close(dest, tensors[name].reshape(-1)[start : start + length].double())
        if name == "m":
            rows = [b - a for a, b in reads]
            assert max(rows) <= 3 and sum(rows) == -(-(start + length) // 11) - start // 11


def test_meta_modules_are_checked_now_and_filled_only_by_zero3(saved):
    root, _ = saved
    with torch.device("meta"):
        model = tiny_gpt2()
    with pytest.raises(ValueError, match="only the zero3 strategy fills such a module"):
        load_pretrained(model, root / "single")
    with deferring():
        with pytest.raises(ValueError, match=r"transformer.wpe.weight: \[32, 32\] in the file, \[16, 32\]"):
            with torch.device("meta"):
                load_pretrained(tiny_gpt2(n_positions=16), root / "single")
        load_pretrained(model, root / "sharded")
    assert len(model.__dict__[_PENDING]) == 1 and model.transformer.wte.weight.is_meta


def test_sources_without_weights_say_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json, model.safetensors"):
        load_pretrained(nn.Linear(2, 2), tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="does not hold a state dict|Could not memory-map"):
        load_pretrained(nn.Linear(2, 2), tmp_path / "notes.txt")


# ---------------------------------------------------------------------- 2 ranks: zero3, zero2, zero1
RUNS = ["zero3/configure_model", "zero3/fit_start", "zero2/configure_model", "zero1/fit_start"]
MIB = 2**20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A GPT-2 of 4.6M parameters (a 32768 x 128 embedding, 16 MiB, tied to the head) saved by ``save_pretrained``."""
    from tests.workers.pretrained import CONFIG

    path = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference_logits(hf_dir):
    from tests.workers.pretrained import FIXED_INPUT

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(FIXED_INPUT).logits


@pytest.fixture(scope="module")
def ranks(hf_dir, tmp_path_factory):
    return launch("pretrained.py", 2, tmp_path_factory.mktemp("ranks"), (str(hf_dir),), timeout=300)


@pytest.mark.parametrize("run", RUNS)
def test_every_stage_starts_from_the_pretrained_logits(ranks, reference_logits, run):
    for rank in ranks:
        torch.testing.assert_close(rank[run]["logits"], reference_logits, rtol=1e-5, atol=1e-5)
        assert rank[run]["loss"] is not None and torch.isfinite(torch.tensor(rank[run]["loss"]))


@pytest.mark.parametrize("run", ["zero3/configure_model", "zero3/fit_start"])
def test_zero3_load_holds_the_shards_plus_at_most_one_tensor(ranks, hf_dir, run):
    """Peak resident memory per rank (see workers/pretrained.py, [Note: measuring a load's peak host memory])."""
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        largest = max(4 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()) / MIB
    for r, rank in enumerate(ranks):
        memory, shards = rank[run]["memory"], rank[run]["shard_bytes"] / MIB
        numbers = (f"rank {r} {run}: shards {shards:.1f} MiB, largest tensor {largest:.1f} MiB, resident MiB "
                   + ", ".join(f"{k} {v:.1f}" for k, v in memory.items()))
        print(numbers)
        assert memory["peak"] - memory["before"] <= largest + 4, numbers  # the load reads one range at a time
        assert memory["after"] - memory["before"] <= 2, numbers  # and keeps nothing but what it wrote into
        if run == "zero3/configure_model":  # from before setup (model on meta); setup's fixed ~12.5 MiB besides
            assert memory["peak"] - memory["baseline"] <= shards + largest + 16, numbers


def test_a_base_model_checkpoint_loads_with_a_prefix_and_hugging_face_ignore_patterns(tmp_path, saved):
    """Hub GPT-2 files come from ``GPT2Model`` (no ``transformer.``) and may hold the old ``attn.bias`` buffers."""
    _, reference = saved
    state = {k.removeprefix("transformer."): v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    torch.save(state, tmp_path / "base.pt")
    model = tiny_gpt2(seed=2)
    with pytest.raises(ValueError, match=r"Did you mean `prefix='transformer\.'`"):
        load_pretrained(model, tmp_path / "base.pt")
    assert load_pretrained(model, tmp_path / "base.pt", prefix="transformer.") == lightning_zero.LoadResult([], [])
    assert_same_weights(model, reference)
