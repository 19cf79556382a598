"""The data path up to a batch: tokens, documents, rows and batches.

tokenizer  the byte tokenizer of the built-in target, and encoding with any tokenizer
corpus     the embedded corpus (the standard library's source), framed and cached
sources    reading text files, folders and JSONL (plain text or conversations)
chat       conversations to token ids, loss masks and turn ends
packing    documents into fixed-length rows (`docs` or `concat`)
documents  positions and attention inside packed rows (what a token may see)
datasets   `Batch` and `PackedDataset`: batch i is a function of (seed, i)
"""
