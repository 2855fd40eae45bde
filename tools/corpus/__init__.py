"""The embedded default model's corpus: the King James Bible, its splits, chat examples,
the byte-level BPE tokenizer and the packed training streams.

Nothing here runs at import time; the heavy work is behind the `build_tokenizer` and
`build_dataset` entry points (`python -m moemesh.tools.corpus.build_tokenizer`, ...).
"""
