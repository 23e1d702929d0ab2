"""zero3 builds a model in ``configure_model`` with exactly the values eager construction gives (same seed).

Single-process tests compare the replayed values of a recorded construction with eager construction tensor by
tensor, bit for bit; the 2-rank test trains Hugging Face GPT-2 and Llama (tiny configs, nothing downloaded), the test
GPT, a module tied the other way and one drawing its weights from torch's random factories (and dropout after) under
ddp and every ZeRO stage, and compares initial states and per-step losses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.stage3.construction import record_construction
from lightning_zero.testing.launch import launch

transformers = pytest.importorskip("transformers")

MODELS = ["gpt2", "llama_tied", "llama", "gpt", "reverse_tied", "random_factories"]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
RTOL = 1e-5


def eager_state(name: str) -> dict[str, torch.Tensor]:
    """What plain PyTorch gives: seed, then ``configure_model`` on the CPU, as ddp does."""
    import lightning as L

    from tests.workers.construction import MODELS as BUILDERS

    L.seed_everything(0, verbose=False)
    module = BUILDERS[name]()
    module.configure_model()
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return state | {f"buffer:{k}": v.detach().clone() for k, v in module.named_buffers()}  # non-persistent too


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("construction")
    return launch("construction.py", 2, out, (",".join(MODELS), ",".join(STRATEGIES)), timeout=900)


@pytest.mark.parametrize("name", MODELS)
def test_every_stage_starts_from_eager_weights_and_trains_like_ddp(trained, name):
    eager = eager_state(name)
    ranks = trained
    for strategy in STRATEGIES:
        initial = ranks[0][name][strategy]["initial"]
        assert initial.keys() == eager.keys(), strategy
        for key, value in eager.items():
            assert torch.equal(initial[key].to(value.dtype), value), f"{strategy}: {key} differs from eager"
    for rank in ranks:
        expected = rank[name]["ddp"]["losses"]
        for strategy in STRATEGIES[1:]:
            losses = rank[name][strategy]["losses"]
            assert len(losses) == len(expected) == 4
            for step, (a, e) in enumerate(zip(losses, expected)):
                assert abs(a - e) <= RTOL * abs(e), f"{name} {strategy} step {step}: loss {a} vs ddp {e}"


def _record(build, device=torch.device("cpu")):
    with record_construction(device) as recording:
        module = build()
    recording.keep(module)
    return module, recording


def _assert_replay_equals_eager(build) -> None:
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.rand(4)
    torch.manual_seed(7)
    module, recording = _record(build)
    after_recording = torch.rand(4)
    assert torch.equal(after_eager, after_recording), "the generator must end where eager construction leaves it"
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    values = recording.values_of(list(tensors.values()))
    reference = dict(eager.named_parameters(remove_duplicate=False)) | dict(eager.named_buffers())
    assert reference.keys() == tensors.keys()
    for (name, expected), value in zip(reference.items(), values):
        assert torch.equal(expected.detach(), value), name


def test_replay_equals_eager_for_hugging_face_models():
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
                                   eos_token_id=0)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    _assert_replay_equals_eager(lambda: transformers.AutoModelForCausalLM.from_config(gpt2))
    _assert_replay_equals_eager(lambda: transformers.AutoModelForCausalLM.from_config(llama))  # rotary inv_freq too


class _Parent(nn.Module):
    """A parent re-initializing children, a module without ``reset_parameters``, data-dependent init, buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16, padding_idx=0)
        self.norm = _RMSNorm(16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 40, bias=False)
        self.embed.weight = self.head.weight  # tied the other way
        for layer in self.layers:
            nn.init.trunc_normal_(layer.weight, std=0.02)
            layer.weight.data[0].zero_()  # a write through a view of a view
        self.layers[2].weight.data *= 1 / 3 ** 0.5  # GPT-2's scaled residual init
        self.register_buffer("inv_freq", 1.0 / (10_000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]))  # from Python data


class _RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))  # initialized in __init__, no reset_parameters


def test_replay_equals_eager_for_ties_reinitialization_views_and_buffers():
    _assert_replay_equals_eager(_Parent)


class _RandomFactories(nn.Module):
    """Parameters and buffers made by torch's random factories inside the module, in several dtypes, one of them
    with a generator of the module's own, between ordinary initializers."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(11)
        self.linear = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.02)
        self.bias = nn.Parameter(torch.rand(8) - 0.5)
        self.scale = nn.Parameter(torch.randn(4, 4, dtype=torch.float64, generator=self.generator))
        self.mixed = nn.Parameter(torch.normal(torch.zeros(3, 5), 2.0) + torch.rand_like(torch.ones(3, 5)))
        self.register_buffer("order", torch.randperm(12))
        self.register_buffer("codes", torch.randint(0, 100, (6,)))
        self.register_buffer("mask", torch.bernoulli(torch.full((10,), 0.5)))
        self.after = nn.Parameter(torch.empty(5).uniform_(-1, 1))


def _generators(module: nn.Module) -> list[torch.Tensor]:
    return [torch.get_rng_state(), module.generator.get_state()]


def test_replay_equals_eager_for_random_factories_inside_the_module():
    """``torch.randn`` / ``rand`` / ``normal`` / ``randperm`` / ``randint`` / ``bernoulli`` inside ``__init__``: the
    values are eager construction's, replayed all at once or unit by unit in any order, and after recording and
    after each replay the default generator and the module's own are where eager construction left them."""
    torch.manual_seed(7)
    eager = _RandomFactories()
    after_eager = _generators(eager)
    torch.manual_seed(7)
    module, recording = _record(_RandomFactories)
    assert all(torch.equal(a, b) for a, b in zip(_generators(module), after_eager)), "recording moved a generator"
    reference = dict(eager.named_parameters()) | dict(eager.named_buffers())
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    assert reference.keys() == tensors.keys() and len(tensors) == 10
    whole = dict(zip(tensors, recording.values_of(list(tensors.values()))))
    one_by_one = {name: recording.values_of([tensors[name]])[0] for name in reversed(list(tensors))}
    for name, expected in reference.items():
        assert torch.equal(whole[name], expected.detach()) and whole[name].dtype == expected.dtype, name
        assert torch.equal(one_by_one[name], expected.detach()), name
    assert all(torch.equal(a, b) for a, b in zip(_generators(module), after_eager)), "replay moved a generator"


def test_replay_needs_one_unit_not_the_model():
    """Replaying one layer runs only the operations that wrote that layer (its memory, not the model's)."""
    module, recording = _record(_Parent)
    layer = module.layers[1].weight
    needed = recording._needed({_storage(recording.recorded[id(layer)])})
    written = set().union(*(op.writes for op in needed))
    others = {_storage(recording.recorded[id(p)]) for n, p in module.named_parameters() if p is not layer}
    assert not written & others, "replaying one layer must not rebuild the others"


def _storage(tensor: torch.Tensor) -> int:
    from lightning_zero.stage3.construction import storage_key

    return storage_key(tensor)
