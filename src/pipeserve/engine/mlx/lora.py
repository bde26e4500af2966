"""LoRA adapters served beside their base model, in one batch: per row, never merged.

`attach_adapters(model, adapters)` (at load, before the layout and the CPU kernels'
swaps, which then replace the base linears inside the wrappers as anywhere else) checks
every adapter against the base (engine/weights/adapters.py), leaves a bad one out with
its reason, and wraps each linear that some adapter adapts in a `MultiLoRALinear`: the
base layer plus every adapter's low-rank matrices stacked (slot k: adapter k; zeros
where adapter k does not adapt that linear). Nothing of the base weights is copied.
An adapter with `load: on_demand` is checked at load and added (`add_adapter`: every
stack one slot deeper) at its first request, between two steps (`LoRARows.ensure`).

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
    on_demand: bool = False  # checked at load, its matrices added at its first request


class LoRARows:
    """The adapters of a model (name -> slot, scale, rank), the failed ones with their
    reasons, each generator row's adapter, and the current forward pass's rows."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears = linears_of(model)  # the base's linears, as loaded (before any swap)
        self.prefix, self.layers = layers_prefix(model)
        self.slots: dict[str, int] = {}
        self.scales: list[float] = []
        self.ranks: list[int] = []
        self.nbytes = 0
        self.failed: dict[str, str] = {}
        self.pending: dict[str, AdapterFiles] = {}  # on_demand adapters not added yet
        self.slot_of: dict[int, int] = {}  # generator uid -> slot
        self.one: int | None = None  # this pass: every row uses this slot
        self.index: mx.array | None = None  # this pass: each row's slot (mixed rows)
        self.row_scale: mx.array | None = None  # this pass: each row's scale (0: no adapter)

    @property
    def names(self) -> set[str]:
        """The adapters requests may use: added, or on_demand and checked."""
        return {*self.slots, *self.pending}

    def ensure(self, adapter: str) -> None:
        """An on_demand adapter's matrices added now (between steps) if they are not
        yet. KeyError: not an adapter of the model (or refused at load)."""
        files = self.pending.get(adapter)
        if files is not None:
            add_adapter(self, files)
            del self.pending[adapter]
            log.info("adapter %s added on demand (%.1f KiB)", adapter, files.nbytes / 1024)
        if adapter not in self.slots:
            raise KeyError(adapter)

    def assign(self, uid: int, adapter: str | None) -> None:
        """Row `uid` decodes with `adapter` (None: the base), which `ensure` added."""
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


def attach_adapters(model: nn.Module, sources: Sequence[AdapterSource]) -> LoRARows | None:
    """Check every adapter against `model` and add the matrices of those loaded at
    startup (see the module docstring); None without adapters. An adapter that does
    not fit is left out, logged with its reason and listed in `LoRARows.failed`; the
    others and the base serve."""
    if not sources:
        return None
    rows = LoRARows(model)
    setattr(model, _ROWS_ATTRIBUTE, rows)  # the loaded model carries its adapters
    for source in sources:
        try:
            files = read_adapter(source.name, source.path)
            check_against(files, rows.linears, rows.layers, rows.prefix)
        except AdapterError as error:
            log.error("%s; the base model serves without it", error)
            rows.failed[source.name] = str(error)
            continue
        if source.on_demand:
            rows.pending[files.name] = files
        else:
            add_adapter(rows, files)
    if rows.slots:
        log.info("adapters %s: %.1f MiB of low-rank matrices", ", ".join(rows.slots),
                 rows.nbytes / (1 << 20))  # fmt: skip
    return rows


def add_adapter(rows: LoRARows, files: AdapterFiles) -> None:
    """Give `files` the next slot: every linear it adapts, and every one already wrapped,
    gets a stack one slot deeper (earlier slots kept, padded to the largest rank)."""
    model, slot = rows.model, len(rows.scales)
    tensors = mx.load(str(files.path / WEIGHTS_FILE))
    modules = dict(model.named_modules())
    wrapped = {p for p, m in modules.items() if isinstance(m, MultiLoRALinear)}
    rank = max([*rows.ranks, files.rank])
    for path in sorted(wrapped | set(files.shapes)):
        dims = rows.linears[path]
        assert dims is not None  # check_against refused anything else
        old = modules[path]
        if isinstance(old, MultiLoRALinear):
            base, a, b, targeted = old.base, old.lora_a, old.lora_b, set(old._targeted)
        else:
            base, targeted = old, set()
            a, b = mx.zeros((slot, dims[0], rank)), mx.zeros((slot, rank, dims[1]))
        a = mx.pad(a, [(0, 0), (0, 0), (0, rank - a.shape[2])])
        b = mx.pad(b, [(0, 0), (0, rank - b.shape[1]), (0, 0)])
        if path in files.shapes:
            targeted.add(slot)
            new_a = tensors[f"{path}.lora_a"].astype(a.dtype)
            new_b = tensors[f"{path}.lora_b"].astype(b.dtype)
        else:
            new_a, new_b = (
                mx.zeros((dims[0], files.rank), a.dtype),
                mx.zeros((files.rank, dims[1]), b.dtype),
            )
        new_a = mx.pad(new_a, [(0, 0), (0, rank - files.rank)])
        new_b = mx.pad(new_b, [(0, rank - files.rank), (0, 0)])
        a = mx.concatenate([a, new_a[None]])
        b = mx.concatenate([b, new_b[None]])
        wrapper = MultiLoRALinear(base, rows, a, b, targeted)
        mx.eval(wrapper.lora_a, wrapper.lora_b)
        model.update_modules(tree_unflatten([(path, wrapper)]))
    rows.slots[files.name] = slot
    rows.scales.append(files.scale)
    rows.ranks.append(files.rank)
    rows.nbytes += files.nbytes


def rows_of(model: nn.Module) -> LoRARows | None:
    """The LoRARows of a model loaded with adapters (attach_adapters); None without."""
    rows = model.__dict__.get(_ROWS_ATTRIBUTE)
    return rows if isinstance(rows, LoRARows) else None
