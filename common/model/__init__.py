"""DeepSeek-V4 model core: config, built-in configs (`presets`), hub/transformers names, the tensor
inventory a checkpoint of a config holds (`inventory`), layers, the attention/experts split, decode state.

Import submodules directly (`common.model.config`, `common.model.names`, ...); this package file is
empty on purpose so that importing the config never imports torch.
"""
