"""Hub-format DeepSeek-V4 checkpoints: quantization formats (`quant`), the tensor inventory of a
config (`inventory`), lazy validated reading (`reader`), writing and random weights (`writer`).

Nothing is imported here, so `import common.checkpoint.inventory` stays torch-free."""
