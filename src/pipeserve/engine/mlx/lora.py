"""LoRA adapters served beside their base model, in one batch: per row, never merged.

`attach_adapters(model, adapters)` (at load, before the layout and the CPU kernels'
swaps, which then replace the base linears inside the wrappers as anywhere else) checks
every adapter against the base (engine/weights/adapters.py), leaves a bad one out with
its reason, and wraps each linear that some adapter adapts in a `MultiLoRALinear`: the
base layer plus every adapter's low-rank matrices stacked (slot k: adapter k; zeros
where adapter k does not adapt that linear). Nothing of the base weights is copied.

Which adapter each row of a forward pass uses is the `LoRARows` of the model, one
object shared by its wrappers: the scheduler assigns a row's adapter by its generator
uid, and the generator calls `use(uids)` with the rows of the batch before each forward
pass (prefill, decode step, speculative verification). A wrapper adds, per row,

    (x @ A_k) @ B_k * scale_k          (mlx-lm's LoRALinear, row by row)

for row k's adapter and nothing for a row without one: when every row uses one adapter
(or none) it is mlx-lm's own expression on that adapter's matrices; a mixed batch takes
two `gather_mm`s over the stacked matrices with a per-row scale (0 for a base row).
Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from pipeserve.engine.weights.adapters import (
    WEIGHTS_FILE,
    AdapterError,
    AdapterFiles,
    Linears,
    check_against,
    read_adapter,
)

log = logging.getLogger("pipeserve.engine")

_ROWS_ATTRIBUTE = "pipeserve_lora_rows"
_NOT_LINEAR = (nn.Embedding, nn.QuantizedEmbedding, SwitchLinear, QuantizedSwitchLinear)


@dataclass(frozen=True)
class AdapterSource:
    name: str
    path: Path


class LoRARows:
    """The adapters of a model (name -> slot, scale, rank), the failed ones with their
    reasons, each generator row's adapter, and the current forward pass's rows."""

    def __init__(self, adapters: Sequence[AdapterFiles], failed: dict[str, str]) -> None:
        self.slots = {files.name: k for k, files in enumerate(adapters)}
        self.scales = [files.scale for files in adapters]
        self.ranks = [files.rank for files in adapters]
        self.nbytes = sum(files.nbytes for files in adapters)
        self.failed = dict(failed)
        self.slot_of: dict[int, int] = {}  # generator uid -> slot
        self.one: int | None = None  # this pass: every row uses this slot
        self.index: mx.array | None = None  # this pass: each row's slot (mixed rows)
        self.row_scale: mx.array | None = None  # this pass: each row's scale (0: no adapter)

    def assign(self, uid: int, adapter: str | None) -> None:
        """Row `uid` decodes with `adapter` (None: the base). KeyError: not loaded."""
        if adapter is not None:
            self.slot_of[uid] = self.slots[adapter]

    def forget(self, uid: int) -> None:
        self.slot_of.pop(uid, None)

    def use(self, uids: Sequence[int]) -> None:
        """The rows of the next forward pass, in the batch's order."""
        slots = [self.slot_of.get(uid) for uid in uids]
        self.index = self.row_scale = None
        self.one = slots[0] if slots and all(s == slots[0] for s in slots) else None
        if self.one is not None or not slots or all(s is None for s in slots):
            return
        self.index = mx.array([0 if s is None else s for s in slots], dtype=mx.uint32)
        scales = [0.0 if s is None else self.scales[s] for s in slots]
        self.row_scale = mx.array(scales, dtype=mx.float32).reshape(-1, 1, 1)


class MultiLoRALinear(nn.Module):
    """A base linear plus the stacked low-rank matrices of every adapter that adapts it."""

    def __init__(
        self, base: nn.Module, rows: LoRARows, a: mx.array, b: mx.array, targeted: set[int]
    ) -> None:
        super().__init__()
        self.base = base
        self.lora_a = a  # (adapters, input dims, max rank)
        self.lora_b = b  # (adapters, max rank, output dims)
        self._rows = rows
        self._targeted = frozenset(targeted)

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        rows = self._rows
        one = rows.one
        if one is not None:
            if one not in self._targeted:
                return y
            rank = rows.ranks[one]
            z = (x @ self.lora_a[one, :, :rank]) @ self.lora_b[one, :rank, :]
            return y + (rows.scales[one] * z).astype(x.dtype)
        if rows.index is None or rows.row_scale is None:
            return y
        z = mx.gather_mm(x, self.lora_a, rhs_indices=rows.index)
        z = mx.gather_mm(z, self.lora_b, rhs_indices=rows.index)
        return y + (rows.row_scale * z).astype(x.dtype)


def linears_of(model: nn.Module) -> Linears:
    """Every linear of the model by path: (input dims, output dims); None for a module
    an adapter may name but that is not served (embeddings, expert layers)."""
    found: Linears = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out_dims, words = module.weight.shape
            found[path] = (words * 32 // module.bits, out_dims)
        elif isinstance(module, nn.Linear):
            out_dims, in_dims = module.weight.shape
            found[path] = (in_dims, out_dims)
        elif isinstance(module, _NOT_LINEAR):
            found[path] = None
    return found


def layers_prefix(model: nn.Module) -> tuple[str, int]:
    """The path of the model's layer list (mlx-lm's `model.layers`) and its length."""
    layers = list(getattr(model, "layers", []))  # mlx-lm's models expose their blocks so
    if not layers:
        raise AdapterError("the base model has no layers to adapt")
    first = layers[0]
    for path, module in model.named_modules():
        if module is first:
            return path.rpartition(".")[0], len(layers)
    raise AdapterError("the base model's layers are not among its modules")


def check_adapter(model: nn.Module, source: AdapterSource) -> AdapterFiles:
    """The adapter's files, checked by themselves and against `model` (AdapterError)."""
    files = read_adapter(source.name, source.path)
    prefix, count = layers_prefix(model)
    check_against(files, linears_of(model), count, prefix)
    return files


def attach_adapters(model: nn.Module, sources: Sequence[AdapterSource]) -> LoRARows | None:
    """Wrap the adapted linears of `model` (see the module docstring); None without
    adapters. An adapter that does not fit is left out, logged with its reason and
    listed in `LoRARows.failed`; the others and the base serve."""
    if not sources:
        return None
    good: list[AdapterFiles] = []
    failed: dict[str, str] = {}
    for source in sources:
        try:
            good.append(check_adapter(model, source))
        except AdapterError as error:
            log.error("%s; the base model serves without it", error)
            failed[source.name] = str(error)
    rows = LoRARows(good, failed)
    setattr(model, _ROWS_ATTRIBUTE, rows)  # the loaded model carries its adapters
    if good:
        _wrap(model, rows, good)
        log.info("adapters %s: %.1f MiB of low-rank matrices", ", ".join(rows.slots),
                 rows.nbytes / (1 << 20))  # fmt: skip
    return rows


def _wrap(model: nn.Module, rows: LoRARows, adapters: list[AdapterFiles]) -> None:
    weights = [mx.load(str(files.path / WEIGHTS_FILE)) for files in adapters]
    linears = linears_of(model)
    modules = dict(model.named_modules())
    rank = max(files.rank for files in adapters)
    targets = sorted({m for files in adapters for m in files.shapes})
    for path in targets:
        dims = linears[path]
        assert dims is not None  # check_against refused anything else
        a_parts, b_parts, targeted = [], [], set()
        for slot, (files, tensors) in enumerate(zip(adapters, weights)):
            if path in files.shapes:
                targeted.add(slot)
                a = tensors[f"{path}.lora_a"].astype(mx.float32)
                b = tensors[f"{path}.lora_b"].astype(mx.float32)
                a_parts.append(mx.pad(a, [(0, 0), (0, rank - files.rank)]))
                b_parts.append(mx.pad(b, [(0, rank - files.rank), (0, 0)]))
            else:
                a_parts.append(mx.zeros((dims[0], rank)))
                b_parts.append(mx.zeros((rank, dims[1])))
        wrapper = MultiLoRALinear(
            modules[path], rows, mx.stack(a_parts), mx.stack(b_parts), targeted
        )
        mx.eval(wrapper.lora_a, wrapper.lora_b)
        model.update_modules(tree_unflatten([(path, wrapper)]))


def rows_of(model: nn.Module) -> LoRARows | None:
    """The LoRARows of a model loaded with adapters (attach_adapters); None without."""
    rows = model.__dict__.get(_ROWS_ATTRIBUTE)
    return rows if isinstance(rows, LoRARows) else None
