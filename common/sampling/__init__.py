"""Random draws shared by the attention worker's sampler and verifier and by the drafter.

Modules: rng (per-request counter-based streams keyed by seed, purpose and position), draw
(Gumbel-max draws from logits or probabilities with those streams). Pure torch, any device.
"""
