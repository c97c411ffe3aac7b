"""Conformance sweep of transformers' causal-LM and seq2seq-LM zoo against seqpar_hf (`python -m conformance.zoo`)."""
