"""`lowbit bench memory`: what one forward of a preset keeps for backward, per recipe.

- saved: the bytes of every tensor autograd saves during the forward (torch.autograd.graph.saved_tensors_hooks,
  eager, each storage counted once; parameters themselves not counted: they exist anyway). The forward runs at
  the batch asked and at batch 1: what grows with the batch is activations, the rest is fixed per step (the bf16
  autocast copies of the weights, FP8 weights and their scales).
- held / peak (GPU): allocator bytes alive after the forward (compiled unless --eager), and the peak of forward +
  backward, above what was allocated before the forward.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.tools.bench.common import Report, Table, error_row, release, variants
from lowbit.tools.bench.step import autocast, batch, build
from lowbit.train.compile import compile_model


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """Plain tensors under a tensor subclass (torchao's Float8TrainingTensor holds its data and scale)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _leaves(getattr(t, n))]
    return [t]


class SavedBytes:
    """Counts the storages autograd saves while active (each once). For a forward that is never backpropagated:
    the graph keeps nothing (a pack hook that returned the tensor itself would tie each saved output to its own
    grad_fn, a reference cycle that leaks the whole graph); the counter holds the saved tensors instead, so their
    memory is not reused (and miscounted) during the forward, until `close()`."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.kept: dict[int, torch.Tensor] = {}
        self.bytes = {"saved": 0, "params": 0}

    def pack(self, t: torch.Tensor):
        for leaf in _leaves(t):
            if leaf.device.type == "meta":
                continue
            s = leaf.untyped_storage()
            ptr = s.data_ptr()
            if ptr in self.kept or ptr == 0:
                continue
            self.kept[ptr] = leaf
            self.bytes["params" if ptr in self.params else "saved"] += s.nbytes()
        return None

    @staticmethod
    def unpack(_):
        raise RuntimeError("lowbit bench: a forward counted by SavedBytes cannot be backpropagated")

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        self.kept.clear()


def run_memory(a, device: torch.device, report: Report) -> None:
    mode = f"compiled ({a.compile_scope})" if a.compile else "eager"
    cuda = device.type == "cuda"
    t = report.table(Table("memory", f"saved for backward, `{a.preset}` forward, {a.batch} x {a.seq}",
                           [("variant", "variant", ""), ("saved_mib", "saved MiB", ",.1f"),
                            ("activations_mib", "activations MiB", ",.1f"), ("activations_vs_bf16", "vs bf16", ".3f"),
                            ("fixed_mib", "fixed MiB (weight copies)", ",.1f"),
                            ("held_mib", f"held after fwd MiB ({mode})", ",.1f"),
                            ("peak_mib", f"fwd+bwd peak MiB ({mode})", ",.1f")]))
    x, y = batch(a.batch, a.seq, a.vocab, device)
    for v in variants(a.recipe_list, a.torchao_list):
        row = {"variant": v.name}
        model = opt = fwd = None
        try:
            model, opt = build(a.model_args, v, device)
            del opt
            saved = {}
            for b in sorted({a.batch, 1}):
                counter = SavedBytes(model)
                with counter.hooks(), autocast(device):
                    loss = model(x[:b], y[:b])
                del loss
                saved[b] = counter.bytes["saved"]
                counter.close()
            act = (saved[a.batch] - saved[1]) * a.batch / (a.batch - 1) if a.batch > 1 else None
            row["saved_mib"] = saved[a.batch] / 2**20
            if act is not None:
                row.update(activations_mib=act / 2**20, fixed_mib=(saved[a.batch] - act) / 2**20)
            if cuda:
                fwd = compile_model(model, a.compile_scope) if a.compile else model
                with autocast(device):  # warm-up: compiles, and scaling state settles
                    fwd(x, y).backward()
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                with autocast(device):
                    loss = fwd(x, y)
                torch.cuda.synchronize(device)
                row["held_mib"] = (torch.cuda.memory_allocated(device) - before) / 2**20
                loss.backward()
                del loss
                torch.cuda.synchronize(device)
                row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        except Exception as e:
            row.update(error_row(e))
        finally:
            model = fwd = None
            release(device)
        report.row(t, row)
    ref = next((r for r in t.rows if r["variant"] == "bf16" and r.get("activations_mib")), None)
    for r in t.rows:
        if ref and "activations_mib" in r:
            r["activations_vs_bf16"] = r["activations_mib"] / ref["activations_mib"]
    t.notes.append("saved: eager forward, bytes of the storages autograd saves (each once, parameters excluded); "
                   "activations: the part that grows with the batch (from a second forward at batch 1), fixed: the "
                   "rest" + ("; held/peak: CUDA allocator, above the bytes allocated "
                                                            "before the forward" if cuda else ""))
    report.save(complete=False)
