"""The multi-process runtime: API process, tokenizer / detokenizer workers, one scheduler per TP rank, over ZMQ."""
