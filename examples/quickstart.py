"""Train a tiny Llama with sequence parallelism: each 1,024-token row is split over an SP group of 2.

Launch it from the repository root:

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py   # CPU: 2 processes (gloo), one SP group
    torchrun --standalone --nproc_per_node 8 examples/quickstart.py   # 8 GPUs (nccl): 4 SP groups of 2
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from seqpar_hf import SequenceParallelArguments, SequenceParallelTrainer

torch.manual_seed(0)  # the same data and initial weights on every rank
config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = LlamaForCausalLM(config)  # a plain transformers model: the trainer patches it for SP itself
rows = (torch.randint(0, 128, (64, 1)) + torch.arange(1024)) % 128  # [64, 1024]: count up from a random token
train = [{"input_ids": row, "labels": row} for row in rows]

args = SequenceParallelArguments(
    output_dir="runs/quickstart",
    sp_size=2,
    max_steps=8,
    learning_rate=3e-3,
    per_device_train_batch_size=4,
    logging_steps=2,
    save_strategy="no",
    report_to="none",
)
trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=train)
trainer.train()  # the ranks of an SP group read the same rows; each computes its half of every row
