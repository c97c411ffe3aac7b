"""Short TRL runs (SFT and DPO) used by tests/test_trl_gloo.py, inside spawned gloo processes.

A tiny Llama, a word-level tokenizer built in memory, pre-tokenized data (no hub access). Each run
returns the logged values; the reference is the plain TRL trainer in one process with the same
global batch.
"""

from __future__ import annotations

import copy
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback

from ..helpers.models import VOCAB, build_model

LOGGED = (
    "loss",
    "grad_norm",
    "eval_loss",
    "mean_token_accuracy",
    "entropy",
    "num_tokens",
    "eval_mean_token_accuracy",
    "eval_entropy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "eval_rewards/margins",
    "eval_logps/chosen",
)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )


def sft_dataset(n: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(9, 40, (1,), generator=g))  # odd and even, all shard boundaries
        rows.append({"input_ids": torch.randint(4, VOCAB, (length,), generator=g).tolist()})
    return Dataset.from_list(rows)


def dpo_dataset(n: int, seed: int) -> Dataset:
    """Text made of the tokenizer's words ("t17 t5 ..."): DPO tokenizes prompt + completion itself."""
    g = torch.Generator().manual_seed(seed)

    def text(lo, hi):
        ids = torch.randint(4, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list(
        [{"prompt": text(4, 12) + " ", "chosen": text(3, 15), "rejected": text(3, 15)} for _ in range(n)]
    )


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items() if k in LOGGED}})


def _common(batch, accumulation, steps, extra):
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=steps,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        lr_scheduler_type="constant",
        bf16=False,
        gradient_checkpointing=False,
    )  # TRL's defaults turn both on
    common.update(extra or {})
    return common


def run_sft(
    sp: int = 0,
    batch: int = 4,
    accumulation: int = 1,
    steps: int = 3,
    mode: str = "ulysses",
    peft: bool = False,
    checkpointing: bool = False,
    packing: bool = False,
    extra: dict | None = None,
    patch_first: bool = True,
    family: str = "llama",
) -> list[dict]:
    """sp=0: plain TRL SFTTrainer (the reference, one process). Otherwise SequenceParallelSFTTrainer."""
    from trl import SFTConfig, SFTTrainer

    if family == "llava":  # a vision-language model, TRL's own collator over its processor's images
        from conformance.images import tiny_vlm

        model = tiny_vlm("llava", "LlavaForConditionalGeneration")
    else:
        model = build_model(family, layers=2)
    kwargs = dict(gradient_checkpointing=checkpointing, max_length=None, **(extra or {}))
    if packing:  # TRL's best-fit-decreasing packing into padding-free rows (position_ids restart per document)
        kwargs.update(packing=True, max_length=64)
    if checkpointing:
        kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    recorder = Recorder()
    data = dict(
        train_dataset=image_dataset(24, 1) if family == "llava" else sft_dataset(24, 1),
        eval_dataset=image_dataset(8, 2) if family == "llava" else sft_dataset(8, 2),
        processing_class=image_processor_class() if family == "llava" else tokenizer(),
        callbacks=[recorder],
        peft_config=peft_config,
    )
    common = _common(batch, accumulation, steps, kwargs)
    if sp == 0:
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), **data)
    else:
        import seqpar_hf
        from seqpar_hf.training.trl import SequenceParallelSFTConfig, SequenceParallelSFTTrainer

        args = SequenceParallelSFTConfig(sp_size=sp, sp_mode=mode, **common)
        if not patch_first:  # TRL first: the trainer patches the model it got
            trainer = SequenceParallelSFTTrainer(model=model, args=args, **data)
        else:
            layout = seqpar_hf.ParallelLayout(sp_size=sp, mode=mode)
            trainer = SequenceParallelSFTTrainer(
                model=seqpar_hf.patch_model(model, layout), args=args, layout=layout, **data
            )
    trainer.train()
    return recorder.logs


def image_processor_class():
    """A LLaVA processor over the tiny LLaVA (conformance/images.py: 16 x 16 images of 4 x 4 patches, 16 image
    tokens each), with a word-level tokenizer whose special tokens are no prefix of its words."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    specials = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<image>": IMAGE_TOKEN, "user": 4, "assistant": 5}
    vocab = {**{f"w{i}": i for i in range(6, IMAGE_TOKEN)}, **specials}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    pixels = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return LlavaProcessor(
        image_processor=pixels,
        tokenizer=words,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS row the "default" strategy drops
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )


# each turn's images first, then its text (as TRL's prepare_multimodal_messages places them)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
)


IMAGE_TOKEN = 127  # the tiny LLaVA's image token id (its vocabulary: 128)


def image_dataset(n: int, seed: int) -> Dataset:
    """Conversations with 0-2 random images each ("messages" and "images": TRL's vision-language format)."""
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        count = int(g.integers(0, 3))
        images = [Image.fromarray(g.integers(0, 256, (16, 24, 3), dtype=np.uint8)) for _ in range(count)]

        def words(lo, hi):
            return " ".join(f"w{i}" for i in g.integers(6, IMAGE_TOKEN, int(g.integers(lo, hi))))

        turns = [{"role": "user", "content": words(3, 15)}, {"role": "assistant", "content": words(3, 15)}]
        rows.append({"messages": turns, "images": images})
    return Dataset.from_list(rows)


def run_dpo(sp: int = 0, batch: int = 4, steps: int = 3, mode: str = "ulysses", ref: str = "copy") -> list[dict]:
    """ref: "copy" (a deep copy of the patched model: sequence-parallel too) or "separate" (a model
    built on its own, not patched: it runs the whole sequence on every rank)."""
    from trl import DPOConfig, DPOTrainer

    model = build_model("llama", layers=2)
    recorder = Recorder()
    data = dict(
        train_dataset=dpo_dataset(16, 3),
        eval_dataset=dpo_dataset(8, 4),
        processing_class=tokenizer(),
        callbacks=[recorder],
    )
    common = _common(batch, 1, steps, dict(max_length=None))
    if sp == 0:
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**common), **data)
    else:
        import seqpar_hf
        from seqpar_hf.training.trl import SequenceParallelDPOConfig, SequenceParallelDPOTrainer

        layout = seqpar_hf.ParallelLayout(sp_size=sp, mode=mode)
        reference = copy.deepcopy(model)
        seqpar_hf.patch_model(model, layout)
        ref_model = copy.deepcopy(model) if ref == "copy" else reference
        trainer = SequenceParallelDPOTrainer(
            model=model,
            ref_model=ref_model,
            layout=layout,
            args=SequenceParallelDPOConfig(sp_size=sp, sp_mode=mode, **common),
            **data,
        )
    trainer.train()
    return recorder.logs


def run_many(configs: list[dict]) -> list[list[dict]]:
    out = []
    for c in configs:
        c = dict(c)
        fn = run_dpo if c.pop("trainer", "sft") == "dpo" else run_sft
        out.append(fn(**c))
    return out


# name -> (sequence-parallel run, the one-process reference). Gradient accumulation compares with one
# process accumulating the same micro-batches: TRL averages its token accuracy and entropy per micro-batch.
CASES = {
    "sft": (dict(), dict()),
    "sft-peft": (dict(peft=True), dict(peft=True)),
    "sft-accumulation": (dict(batch=2, accumulation=2), dict(batch=2, accumulation=2)),
    "sft-packing": (dict(packing=True), dict(packing=True)),
    "sft-peft-packing-checkpointing": (
        dict(peft=True, packing=True, checkpointing=True),
        dict(peft=True, packing=True, checkpointing=True),
    ),
    "sft-ring": (dict(mode="ring"), dict()),
    "sft-qwen3_5-gated-deltanet": (dict(family="qwen3_5", checkpointing=True), dict(family="qwen3_5")),
    # images through TRL's vision-language collator (LLaVA's processor): the vision tower on 1/sp of them
    "sft-llava-images": (dict(family="llava", mode="ring"), dict(family="llava")),
    "sft-model-patched-by-the-trainer": (dict(patch_first=False), dict()),
    "dpo-reference-a-deep-copy": (dict(trainer="dpo"), dict(trainer="dpo")),
    "dpo-separate-reference": (dict(trainer="dpo", ref="separate"), dict(trainer="dpo")),
}
