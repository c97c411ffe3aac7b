"""The cause of a REFUSED row, in a few words, from its message (for the summary tables of zoo.md and
the README). Every refusal message names the module or value itself; this only groups them."""

from __future__ import annotations

import re

CAUSES = (  # (pattern in the message, cause), first match wins
    (r"computes attention itself", "attention written by hand, not through AttentionInterface (named)"),
    (
        r"prepared on the full sequence|hands its text model|merged into the text before its text model",
        "images: the text model is handed what is not sharded (Gemma 3's masks for its image blocks; named)",
    ),
    (
        r"relative position bias is one table for all heads",
        "tensor parallelism: a relative position bias table shared by all heads (T5)",
    ),
    (
        r"runs on the whole sequence, which tensor parallelism|not under tensor parallelism",
        "a token mixer (a convolution or a scan) under tensor parallelism (named)",
    ),
    (
        r"mixes tokens without attention",
        "token mixers without attention through the interface that no split applies to (RWKV, xLSTM: nothing divided)",
    ),
    (
        r"caches a token mixer's states|token mixers' states .* in a cache of its own|has no layer index of its own",
        "generate: mixer states in a cache of the model's own, or attention shared by several layers (named)",
    ),
    (
        r"runs a convolution|runs a scan|mixes information along the sequence|selects among the tokens",
        "token mixing outside attention: convolution, SSM / linear-attention scan, recurrence, positions made "
        "from the shard (named)",
    ),
    (r"decides for each token from the batch", "expert routing with capacity counted over the tokens (named)"),
    (
        r"attend across the documents",
        "packed rows (packed only): the model's own code lets the documents of a row attend to each other (named)",
    ),
    (r"generate on a tensor-parallel model", "generate under tensor parallelism (generate on tp2 only)"),
    (
        r"passes \w+= to the attention function",
        "an attention keyword the sharded attention does not honour, seen at run time (named)",
    ),
    (
        r"passes (softcap|s_aux|sinks|position_bias|indices|block_indices)=",
        "an attention keyword the sharded attention does not honour: position bias, sparse indices (named)",
    ),
    (
        r"is given a pattern other than|says is_causal",
        "an attention mask it cannot reproduce: blockwise, prefix, learned bias, or is_causal against the mask (named)",
    ),
    (r"relative position bias|ALiBi", "relative position bias other than T5's, or ALiBi, over the whole sequence"),
    (r"temperature tuning", "a query scale by index that does not match the one proven (Llama 4)"),
    (
        r"no shift|not the token-mean|shifts its encoder-decoder labels",
        "a loss other than the causal / "
        "seq2seq token-mean cross-entropy (e.g. *ForCausalLM of encoder-decoder families, no label shift)",
    ),
    (
        r"takes no position_ids|does not take position ids|makes its own positions",
        "positions a shard cannot be given (a backbone or position table without position ids)",
    ),
    (r"several modules it calls itself", "two models in one forward (encoder and decoder run separately)"),
    (r"not a sequence of the model", "attention over keys that are not a sequence (patches, memory)"),
    (
        r"fails on a shard|fails in a plain forward|fails in a training-mode",
        "cannot run on part of the sequence (named module)",
    ),
    (r"tensor parallelism", "tensor parallelism: a plan entry, weight or input the TP plan does not cover"),
    (r"bidirectional \(encoder-only\)", "encoder-only model"),
)


def cause(reason: str) -> str:
    for pattern, label in CAUSES:
        if re.search(pattern, reason):
            return label
    return "other"
