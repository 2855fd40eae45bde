"""Drafting with the DSpark drafter, as a library both placements share: the feature rings, the
batched proposal of a block per request, the Markov chains, and the drafter's options. The draft
worker service (`services/draft/`) and the attention worker's in-process drafter
(`services/attention/local_drafter.py`) both run it."""
