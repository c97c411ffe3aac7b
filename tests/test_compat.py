"""Tier 1: every private attribute seqpar_hf reaches (all in seqpar_hf/_compat.py, plus the Trainer hooks
it overrides) still exists, so an upgrade of torch, transformers, accelerate or TRL fails here, by name.
No process group needed. Also the ring block kernels against the math path, and their fallback."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from seqpar_hf import _compat
from seqpar_hf.attention import kernels

from .helpers.models import relative_error


def test_torch_device_mesh_flatten():
    from torch.distributed.device_mesh import DeviceMesh

    assert "mesh_dim_name" in inspect.signature(DeviceMesh._flatten).parameters


def test_torch_outer_saved_tensors_hooks():
    def pack(t):
        return t

    assert _compat.outer_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert _compat.outer_saved_tensors_hooks()[0] is pack


def test_torch_process_group_timeout_getter_and_setter(tmp_path):
    """ParallelLayout gives the mesh's groups the default group's timeout: read from the backend's options
    (`_compat.group_timeout`), set with `ProcessGroup.set_timeout`."""
    from datetime import timedelta

    import torch.distributed as dist

    assert hasattr(dist.ProcessGroup, "set_timeout")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=42))
    try:
        assert _compat.group_timeout(None) == timedelta(seconds=42)
        dist.group.WORLD.set_timeout(timedelta(seconds=7))
        assert _compat.group_timeout(None) == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


def test_torch_private_attention_ops_exist():
    for device in ("cpu", "cuda"):
        for name in _compat._RING_OPS[device]:
            assert hasattr(torch.ops.aten, name), name


def test_torch_varlen_kernel_takes_scale_and_window():
    """Packed attention on CUDA (half precision) goes through varlen_attn(..., scale=, window_size=)."""
    assert _compat.varlen_attention() is not None, torch.__version__


def test_accelerate_marks_and_registers_prepared_loaders():
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(4)), batch_size=2))
    assert _compat.is_prepared_data_loader(loader)  # Accelerator.prepare marks what it prepared
    assert loader in accelerator._dataloaders
    other = prepare_data_loader(
        torch.utils.data.DataLoader(list(range(4)), batch_size=2), torch.device("cpu"), num_processes=1, process_index=0
    )
    _compat.register_data_loader(accelerator, other)
    assert other in accelerator._dataloaders


def test_transformers_trainer_hooks_we_override_or_read():
    from transformers import Seq2SeqTrainer, Trainer

    assert list(inspect.signature(Trainer._get_eval_sampler).parameters) == ["self", "eval_dataset"]
    assert "self._train_batch_size" in inspect.getsource(Trainer.get_total_train_batch_size)
    assert "self._gen_kwargs = " in inspect.getsource(Seq2SeqTrainer.evaluate)
    source = inspect.getsource(Trainer)
    assert "model_accepts_loss_kwargs" in source  # documented attributes we set
    # transformers >= 5.2x reads loss_is_scaled_for_ga; 5.17 skips the division by the accumulation
    # steps when model_accepts_loss_kwargs is set (and num_items_in_batch given), which we also set
    assert (
        "loss_is_scaled_for_ga" in source
        or "not self.model_accepts_loss_kwargs or num_items_in_batch is None" in source
    )
    signatures = {
        "_save_optimizer_and_scheduler": ["self", "output_dir"],
        "_load_optimizer_and_scheduler": ["self", "checkpoint"],
        "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
        "_save": ["self", "output_dir", "state_dict"],
        "_save_checkpoint": ["self", "model", "trial"],
        "_get_output_dir": ["self", "trial"],
        "_save_scaler": ["self", "output_dir"],
        "_save_rng_state": ["self", "output_dir"],
        "_issue_warnings_after_load": ["self", "load_result"],
    }
    assert set(signatures) == set(_compat.TRAINER_CHECKPOINT_HOOKS)
    for name, params in signatures.items():
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == params, name
    # gradient norm of DTensor models (overridden by SequenceParallelTrainer)
    assert list(inspect.signature(Trainer._clip_grad_norm).parameters) == ["self", "model"]
    assert list(inspect.signature(Trainer._get_grad_norm).parameters) == ["self", "model", "grad_norm"]
    import transformers.trainer as trainer_module

    for name in ("OPTIMIZER_NAME", "SCHEDULER_NAME", "SAFE_WEIGHTS_NAME", "TRAINER_STATE_NAME"):
        assert getattr(trainer_module, name) == getattr(_compat, name), name
    # training/saving.py points the Trainer's own _save_checkpoint at a temporary folder through
    # _get_output_dir, and defers the failed writes of the hooks it calls
    save = inspect.getsource(Trainer._save_checkpoint)
    assert "run_dir = self._get_output_dir(trial=trial)" in save and "os.path.join(run_dir, checkpoint_folder)" in save
    for call in (
        "self.save_model(output_dir, _internal_call=True)",
        "self._save_optimizer_and_scheduler(output_dir)",
        "self._save_scaler(output_dir)",
        "self._save_rng_state(output_dir)",
    ):
        assert call in save, call
    assert "self._issue_warnings_after_load(load_result)" in inspect.getsource(Trainer._load_from_checkpoint)


@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d_v", [8, 6, 12])  # v's own head width (latent attention): the CPU kernel takes one width
def test_cpu_block_kernels_match_the_math(causal, masked, d_v):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, d_v)
    bias = None
    if masked:
        allowed = torch.rand(2, 1, 16, 16) > 0.3
        allowed[..., 0] = True  # every row sees a key
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out, lse = kernels.block_forward(q, k, v, bias, causal, 8**-0.5)
    ref_out, ref_lse = kernels.math_forward(q, k, v, bias, causal, 8**-0.5)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5
    dout = torch.randn_like(out)
    grads = kernels.block_backward(dout, q, k, v, out, lse, bias, causal, 8**-0.5)
    ref = kernels.math_backward(dout, q, k, v, ref_out, ref_lse, bias, causal, 8**-0.5)
    for g, r in zip(grads, ref):
        assert relative_error(g, r) < 1e-5


def test_missing_kernel_falls_back_to_the_math_with_one_warning(monkeypatch):
    monkeypatch.setitem(_compat._RING_OPS, "cpu", ("_no_such_op_forward", "_no_such_op_backward"))
    monkeypatch.setattr(_compat, "_checked", {})
    q = torch.randn(1, 2, 8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = kernels.block_forward(q, q, q, None, True, 0.5)
        kernels.block_forward(q, q, q, None, True, 0.5)
    assert sum("math path" in str(w.message) for w in caught) == 1
    ref_out, _ = kernels.math_forward(q, q, q, None, True, 0.5)
    assert torch.equal(out, ref_out)


def test_tied_embedding_plan_entry_of_transformers_5_17_is_ours_to_parallelise():
    """transformers 5.17 adds "embed_tokens": "embedding_rowwise" to the tp plan of tied-embedding models;
    seqpar_hf parallelises the embedding itself (vocab-parallel), so the entry is skipped, not refused."""
    from seqpar_hf.models.proof.inspection import inspect_model
    from seqpar_hf.models.tp.tensor_parallel import decoder_only_plan

    from .helpers.models import build_model

    model = build_model("llama")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    plan = decoder_only_plan(inspect_model(model), None)
    assert "embed_tokens" not in plan and "layers.*.self_attn.q_proj" in plan


def test_transformers_config_attention_implementation_reads_back():
    from .helpers.models import build_model

    model = build_model("llama")
    model.set_attn_implementation("eager")
    assert _compat.attn_implementation(model.config) == "eager"


def test_transformers_generation_internals_for_generation_under_sp():
    """generate under SP merges the call's settings as generate does (`_prepare_generation_config`), runs a
    decoding step's replicated self-attention with the model's own function (the modeling file's
    `eager_attention_forward` for "eager"), and subclasses `Cache` / `CacheLayerMixin`."""
    import importlib

    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.cache_utils import Cache, CacheLayerMixin

    from .helpers.models import build_model

    assert list(inspect.signature(LlamaForCausalLM._prepare_generation_config).parameters) == [
        "self",
        "generation_config",
        "kwargs",
    ]
    config, rest = _compat.prepare_generation_config(build_model("llama"), None, {"max_new_tokens": 3, "foo": 1})
    assert isinstance(config, GenerationConfig) and config.max_new_tokens == 3 and rest == {"foo": 1}
    for name in (
        "marian.modeling_marian",
        "bart.modeling_bart",
        "m2m_100.modeling_m2m_100",
        "llama.modeling_llama",
        "mistral.modeling_mistral",
        "qwen2.modeling_qwen2",
    ):
        assert callable(importlib.import_module(f"transformers.models.{name}").eager_attention_forward), name
    model = build_model("marian")
    assert (
        _compat.original_attention_function(model.model.decoder.layers[0].self_attn, "eager").__module__
        == "transformers.models.marian.modeling_marian"
    )
    assert {"update", "get_seq_length", "get_mask_sizes", "reorder_cache"} <= set(vars(Cache))
    assert CacheLayerMixin.__abstractmethods__ <= {
        "lazy_initialization",
        "update",
        "get_mask_sizes",
        "get_seq_length",
        "get_max_length",
    }
    assert "layers" in inspect.signature(Cache.__init__).parameters


def test_trl_grpo_hooks_the_rl_trainers_override():
    """seqpar_hf/training/trl_rl.py overrides these private GRPO / RLOO methods (one slice per rank, the
    group's rows for the loss): their names and leading parameters."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer, RLOOTrainer

    for trainer in (GRPOTrainer, RLOOTrainer):
        assert list(inspect.signature(trainer._generate_and_score_completions).parameters)[:2] == ["self", "inputs"]
        assert list(inspect.signature(trainer._generate_single_turn).parameters)[:2] == ["self", "prompt_ids"]
        assert list(inspect.signature(trainer._get_per_token_logps_and_entropies).parameters)[:5] == [
            "self",
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
        ]
        assert hasattr(trainer, "_get_eval_sampler")
        assert "self._tokenizer = processing_class" in inspect.getsource(trainer.__init__)  # _compat.trl_tokenizer


def test_torch_tensor_version_counter():
    t = torch.zeros(2)
    before = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == before + 1


def test_set_attention_scopes_the_implementation_to_the_backbone_sub_config():
    """`set_attn_implementation` takes a nested dict keyed by sub-config: a VLM's text model gets the name, its
    vision tower keeps its own (`_compat.set_attention`, used by patch_model)."""
    from transformers import Qwen2VLForConditionalGeneration

    from conformance.tiny import build_config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    model = Qwen2VLForConditionalGeneration(
        build_config("qwen2_vl", {"text_config": {"rope_parameters": rope}, "vision_config": {"depth": 1}})
    )
    text, vision = model.model.language_model, model.model.visual
    _compat.set_attention(model, text, "eager")
    assert text.config._attn_implementation == "eager" and vision.config._attn_implementation == "sdpa"
    assert _compat.backbone_attn_implementation(model, text) == "eager"
