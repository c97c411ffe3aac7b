"""Tier 1 (one process, no process group): the offload of checkpointed layer inputs and the tiled MLP
(seqpar_hf/memory/) against the unpatched model, with and without each, and their refusals. Multi-rank
parity (ulysses, ring, hybrid, packed rows): the `memory` cases of tests/runs/parity.py and packing.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import seqpar_hf
from seqpar_hf.memory.offload import LayerInputOffload
from seqpar_hf.memory.tiled_mlp import TiledForward

from .helpers.models import build_model, make_batch, relative_error
from .runs.parity import grad_errors

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
TOL = 1e-5  # fp32: the tiled MLP sums its weight gradients per tile (another order than one matmul)
SP1 = seqpar_hf.ParallelLayout(sp_size=1)


def _trained(model, batch, checkpointing: bool = True):
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_offload_is_bit_identical_and_moves_every_layer_input():
    batch = make_batch("llama", seed=3)
    plain, offloaded = build_model("llama"), build_model("llama")
    seqpar_hf.patch_model(plain, SP1)
    seqpar_hf.patch_model(offloaded, SP1, offload_activations=True)
    loss, loss_off = _trained(plain, batch), _trained(offloaded, batch)
    offload = offloaded._seqpar_state.offload
    rows, length = batch["input_ids"].shape
    layers = offloaded.config.num_hidden_layers
    # exactly the layer inputs [b, s, h] (fp32), one per checkpointed layer, and each brought back once
    assert (offload.moved, offload.restored) == (layers, layers)
    assert offload.moved_bytes == layers * rows * length * offloaded.config.hidden_size * 4
    assert torch.equal(loss, loss_off)
    expected, got = _grads(plain), _grads(offloaded)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)


@pytest.mark.parametrize("family", ["llama", "marian"])
@pytest.mark.parametrize(
    "options", [dict(offload_activations=True), dict(tiled_mlp=2), dict(offload_activations=True, tiled_mlp=1)]
)
def test_memory_options_match_the_unpatched_model(family, options):
    if family == "marian" and "tiled_mlp" in options:
        options = {**options, "tiled_mlp": "auto"}  # Marian's layers have no MLP child (fc1/fc2): left whole
    model = build_model(family)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        seqpar_hf.patch_model(model, SP1, **options)
    batch = make_batch(family, seed=3)
    loss, expected = _trained(model, batch), _trained(reference, batch)
    assert relative_error(loss, expected) < TOL
    err, name = grad_errors(model, reference)
    assert err < TOL, name


def test_tiled_mlp_never_holds_the_whole_intermediate():
    model = build_model("llama")
    reference = copy.deepcopy(model)
    seqpar_hf.patch_model(model, SP1, tiled_mlp=6)  # 6 tokens per tile: 2 positions of the 3 rows
    assert model._seqpar_state.tiled_mlps == ["model.layers.0.mlp", "model.layers.1.mlp"]
    seen: list[int] = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    batch = make_batch("llama", seed=3)
    loss, expected = _trained(model, batch, checkpointing=False), _trained(reference, batch, checkpointing=False)
    hook.remove()
    length = batch["input_ids"].shape[1]
    assert max(seen) == 2 and len(seen) == 2 * -(-length // 2)  # the forward's tiles, then the backward's
    assert relative_error(loss, expected) < TOL
    err, name = grad_errors(model, reference)
    assert err < TOL, name
    seqpar_hf.unpatch_model(model)
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_tiled_mlp_auto_tiles_above_the_threshold_only():
    model = build_model("llama")
    seqpar_hf.patch_model(model, SP1, tiled_mlp="auto")
    forward = model.model.layers[0].mlp.forward
    assert isinstance(forward, TiledForward)
    hidden = model.config.hidden_size
    assert forward.tile_length(torch.zeros(1, 100, hidden)) is None  # 100 x ffn elements: whole
    assert forward.tile_length(torch.zeros(1, -(-(2**26) // forward.width), hidden)) == hidden  # hidden-size tiles


class _MixingMLP(nn.Module):
    """Token-mixing: each token's output depends on the sequence's mean (what a tile cannot reproduce)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.down(torch.relu(self.up(x - x.mean(1, keepdim=True))))


class _DropoutMLP(_MixingMLP):
    def forward(self, x):
        return self.down(nn.functional.dropout(self.up(x), 0.5, self.training))


@pytest.mark.parametrize(
    "kind,message",
    [
        ("mixing", "model.layers.0.mlp (_MixingMLP) cannot be computed over sequence tiles: it is not token-local"),
        ("dropout", "model.layers.0.mlp (_DropoutMLP) cannot be computed over sequence tiles: it draws random"),
        (
            "mixtral",
            "model.layers.0.mlp (MixtralSparseMoeBlock) cannot be computed over sequence tiles: its "
            "MixtralTopKRouter outputs are collected by the model's output recorders",
        ),
        ("marian", "model.encoder.layers.0 (MarianEncoderLayer) cannot be computed over sequence tiles: it has no MLP"),
    ],
)
def test_tiled_mlp_refusals(kind, message):
    model = build_model("llama" if kind in ("mixing", "dropout") else kind)
    if kind in ("mixing", "dropout"):
        hidden = model.config.hidden_size
        model.model.layers[0].mlp = (_MixingMLP if kind == "mixing" else _DropoutMLP)(hidden)
    model.train()
    with pytest.raises(ValueError, match=r"^tiled_mlp=True: " + message.replace("(", r"\(").replace(")", r"\)")):
        seqpar_hf.patch_model(model, SP1, tiled_mlp=True)
    # "auto" leaves it whole, saying why
    with pytest.warns(UserWarning, match="tiled_mlp='auto' leaves these MLPs whole"):
        seqpar_hf.patch_model(model, SP1, tiled_mlp="auto")


@pytest.mark.parametrize("value", [0, -3, "yes", 1.5])
def test_tiled_mlp_bad_values(value):
    with pytest.raises(ValueError, match="use True, False, 'auto' or a positive number of tokens per tile"):
        seqpar_hf.patch_model(build_model("llama"), SP1, tiled_mlp=value)


def test_offload_without_gradient_checkpointing_is_refused():
    model = seqpar_hf.patch_model(build_model("llama"), SP1, offload_activations=True)
    batch = make_batch("llama", seed=3)
    model.eval()
    model(**batch)  # evaluation: nothing to offload, nothing to say
    model.train()
    with torch.no_grad():
        model(**batch)
    with pytest.raises(
        ValueError,
        match=r"offload_activations=True offloads the layer inputs that gradient "
        r"checkpointing keeps, and LlamaForCausalLM trains without gradient checkpointing",
    ):
        model(**batch)


def test_offload_restores_the_checkpoint_functions_on_unpatch():
    model = build_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    original = model.model.layers[0]._gradient_checkpointing_func
    seqpar_hf.patch_model(model, SP1, offload_activations=True)
    model.train()
    model(**make_batch("llama", seed=3)).loss.backward()
    assert model.model.layers[0]._gradient_checkpointing_func is not original
    seqpar_hf.unpatch_model(model)
    assert model.model.layers[0]._gradient_checkpointing_func is original


def test_offload_hooks_copy_exactly():
    offload = LayerInputOffload()
    x = torch.randn(2, 5, 3, requires_grad=True)
    with offload.hooks:
        y = torch.sin(x).sum()  # saves x
    y.backward()
    assert torch.equal(x.grad, torch.cos(x.detach())) and offload.moved == offload.restored == 1


def test_trainer_flags_become_patch_options():
    args = seqpar_hf.SequenceParallelArguments(
        output_dir="/tmp/unused", use_cpu=True, sp_offload_activations=True, sp_tiled_mlp="4096", report_to=[]
    )
    assert args.patch_options() == dict(offload_activations=True, tiled_mlp=4096)
    with pytest.raises(ValueError, match="sp_tiled_mlp='sometimes': use true, false, auto or a positive number"):
        seqpar_hf.SequenceParallelArguments(output_dir="/tmp/unused", use_cpu=True, sp_tiled_mlp="sometimes")
