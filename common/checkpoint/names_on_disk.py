"""Map the entry names found in a safetensors checkpoint to hub names.

Three spellings reach us:
- hub format (the official release and our writer): `layers.3.attn.wq_a.weight` + `.scale`;
- V3-style scale names: `…weight_scale_inv` instead of `…scale` (same multiplier);
- transformers' `save_pretrained` output: `model.` prefix, `model.embed_tokens.weight`,
  `model.hc_head.hc_fn`, `attn.norm.weight` for the attention's kv_norm, per-expert experts — or,
  from other versions / in-memory state dicts, transformers module names with fused experts
  (`model.layers.3.mlp.experts.gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`).

`resolve_entry` turns one on-disk name into one or more `EntryRef`s: a hub entry name plus the
index to apply to the stored tensor (an expert's rows of a fused tensor), so a reader can still
read a single expert without touching the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moemesh.common.model.names import UnknownTensorName, expert_hub_name, hf_name_to_hub

_SAVED_LAYER = re.compile(r"^model\.(layers\.\d+\..+)$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_KV_NORM_SAVED = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


@dataclass(frozen=True)
class EntryRef:
    """Where one hub entry lives: `stored_name` in `file`, optionally a slice of it.

    `expert` selects dim 0 of a fused tensor; `rows` (start, stop) then selects dim 0 of that expert
    (w1 = first I rows of gate_up, w3 = the rest).
    """

    hub_name: str
    file: str
    stored_name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


def _hub_name_of_plain(name: str, known: set[str]) -> str | None:
    """Hub name of a non-fused on-disk name, or None if it maps to nothing we know."""
    if name in known:
        return name
    candidates = []
    try:
        candidates.append(hf_name_to_hub(name))
    except UnknownTensorName:
        pass
    if name == "lm_head.weight":
        candidates.append("head.weight")
    match = _SAVED_LAYER.match(name)
    stripped = match.group(1) if match else name.removeprefix("model.")
    candidates.append(stripped)
    kv_norm = _KV_NORM_SAVED.match(stripped)
    if kv_norm:
        candidates.append(f"{kv_norm.group(1)}.kv_norm.weight")
    for candidate in candidates:
        if candidate in known:
            return candidate
    return None


def resolve_entry(
    name: str, file: str, known: set[str], shape: tuple[int, ...], moe_intermediate_size: int
) -> list[EntryRef]:
    """On-disk entry -> hub entries it provides (empty list: unknown name)."""
    if name.endswith(".weight_scale_inv"):
        weight_hub = _hub_name_of_plain(name.removesuffix("_scale_inv"), {n.removesuffix(".scale") + ".weight" for n in known if n.endswith(".scale")})
        if weight_hub is None:
            return []
        return [EntryRef(weight_hub.removesuffix(".weight") + ".scale", file, name)]
    fused = _FUSED.match(name)
    if fused:
        layer, kind = int(fused.group(1)), fused.group(2)
        refs = []
        for expert in range(shape[0] if shape else 0):
            if kind == "gate_up_proj":
                inter = moe_intermediate_size
                refs.append(EntryRef(expert_hub_name(layer, expert, "w1"), file, name, expert, (0, inter)))
                refs.append(EntryRef(expert_hub_name(layer, expert, "w3"), file, name, expert, (inter, 2 * inter)))
            else:
                refs.append(EntryRef(expert_hub_name(layer, expert, "w2"), file, name, expert))
        return [ref for ref in refs if ref.hub_name in known]
    hub = _hub_name_of_plain(name, known)
    return [] if hub is None else [EntryRef(hub, file, name)]


def ref_shape(ref: EntryRef, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the hub entry `ref` selects from a stored tensor of `stored_shape`."""
    shape = stored_shape
    if ref.expert is not None:
        shape = shape[1:]
        if ref.rows is not None:
            shape = (ref.rows[1] - ref.rows[0],) + shape[1:]
    return tuple(shape)
