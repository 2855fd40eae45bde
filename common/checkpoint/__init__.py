"""Hub-format DeepSeek-V4 checkpoints: quantization formats (`quant`), lazy validated reading
(`reader`), writing and random weights (`writer`), against the tensor inventory of a config
(`common.model.inventory`).

Nothing is imported here, so importing one submodule loads only what it needs."""
