"""Named numerics recipes and `convert(model, recipe)`, which swaps a plain model's nn.Linear layers for
LowPrecisionLinear ones. A recipe is data (a frozen dataclass), not a code path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Callable

from torch import nn

from lowbit.numerics.activations import compress_saved_activations
from lowbit.numerics.attention import swap_attention
from lowbit.errors import LowbitError
from lowbit.numerics.fp4 import DGE, OCC, check_fp4_dims
from lowbit.numerics.fused_producers import install_fused_producers
from lowbit.numerics.linear import LinearRecipe, LowPrecisionLinear
from lowbit.optim.precision import StatePrecision
from lowbit.numerics.scaling import Scaling


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    linear: LinearRecipe | None = None  # None: every linear stays in the compute dtype
    keep_lm_head: bool = True  # the output head stays high precision (its logits feed the softmax directly)
    keep_first_last: bool = False  # the first and last transformer blocks stay high precision
    min_dim: int = 0  # linears with in or out features below this stay high precision (too small to gain)
    keep: tuple[str, ...] = ()  # linears that stay high precision, by name: a glob ("layers.0.*") or a suffix ("w2")
    # filter(module, name): False leaves that linear high precision (torchao's module_filter_fn), beside the above
    filter: Callable[[nn.Module, str], bool] | None = None
    optim: StatePrecision = StatePrecision()  # storage of the covered weights and their optimizer states
    needs_grad_clip: bool = False  # the recipe is only stable with gradient clipping (train.grad_clip > 0)
    # SwiGLU's and the norms' inputs kept for backward in this format, a scale per token (COAT); None: as
    # computed. Less activation memory, approximate gradients (lowbit.numerics.activations).
    saved_activations: Scaling | None = None
    # the blocks' norms and SwiGLU write their output as FP8 for the linears reading it (numerics.fused_producers)
    fused_producers: bool = False
    # numerics.fp8_attention: the causal attention cores on E4M3 Q, K, V and P (lowbit.numerics.attention); needs
    # FP8 linears. Off in every named recipe until a convergence study says otherwise.
    fp8_attention: bool = False


def _fp8(inp: Scaling, weight: Scaling, grad: Scaling, **kw) -> LinearRecipe:
    return LinearRecipe(input=inp, weight=weight, grad_output=grad, **kw)


_NANOTRON = dict(strategy="delayed", history=16, interval=16)
_TE_DELAYED = dict(strategy="delayed", history=1024, algo="max")
_FP8LM_WINDOW = dict(strategy="delayed", history=16, algo="max", pow2=True, warmup=16)  # MS-AMP's warm-up
_FP8LM_LINEAR = _fp8(Scaling("e4m3", **_FP8LM_WINDOW), Scaling("e4m3", pow2=True), Scaling("e5m2", **_FP8LM_WINDOW))
_O1 = StatePrecision(grads="e4m3")
# O2's weights FP16 with a per-tensor scale, as MS-AMP's (docs/convergence.md: -0.21% to bf16 on training loss,
# +1.56% with bf16 weights)
_O2 = StatePrecision(weights="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")

# FP4 (Wang et al. 2025): E2M1 weights per output channel, E2M1 activations per token, E4M3 row-wise gradients
# (the row-wise FP8 kernel takes E4M3 only); FP8 weight gradients and first moment, FP16 second moment.
_FP4 = LinearRecipe(input=Scaling("e2m1", "row"), weight=Scaling("e2m1", "row"), grad_output=Scaling("e4m3", "row"),
                    dge=DGE(), occ=OCC())
_FP4_OPTIM = StatePrecision(grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")

RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("bf16", "baseline: every linear computes in train.dtype (bf16 autocast on GPU)"),
    Recipe("fp8-tensorwise", "FP8, one current scale per tensor: E4M3 forward, E5M2 gradients (torchao tensorwise)",
           _fp8(Scaling("e4m3"), Scaling("e4m3"), Scaling("e5m2"))),
    Recipe("fp8-tensorwise-coat", "fp8-tensorwise + SwiGLU and RMSNorm inputs kept for backward as E4M3 with a "
           "scale per token (COAT-style activation compression; approximate gradients)",
           _fp8(Scaling("e4m3"), Scaling("e4m3"), Scaling("e5m2")), saved_activations=Scaling("e4m3", "row")),
    Recipe("fp8-delayed", "FP8 with delayed scaling, amax history 1024 (max), TransformerEngine DelayedScaling HYBRID",
           _fp8(Scaling("e4m3", **_TE_DELAYED), Scaling("e4m3", **_TE_DELAYED), Scaling("e5m2", **_TE_DELAYED))),
    Recipe("fp8lm", "FP8-LM/MS-AMP windows: input and output-grad history 16, weight current, power-of-two scales",
           _FP8LM_LINEAR),
    Recipe("fp8lm-o1", "FP8-LM O1: fp8lm GEMMs + E4M3 weight gradients, fp32 optimizer states (13 bytes/param)",
           _FP8LM_LINEAR, optim=_O1),
    Recipe("fp8lm-o2", "FP8-LM O2: O1 + first moment E4M3, second moment FP16 with a scale, FP16 weights with a "
           "per-tensor scale as their own master (6 bytes/param)", _FP8LM_LINEAR, optim=_O2),
    Recipe("fp8lm-o3", "FP8-LM O3: O2 + an FP16 master with a per-tensor scale (8 bytes/param here: FP8 weight "
           "storage is not implemented, see docs/numerics.md)", _FP8LM_LINEAR,
           optim=StatePrecision(weights="bf16", master="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")),
    # stochastic rounding: under round-to-nearest an E5M2 second moment never decays by beta2 (docs/convergence.md:
    # +3.78% to bf16; rounded stochastically, +0.11% and +1.36% in two runs)
    Recipe("nanotron-r2", "nanotron FP8 recipe 2: FP8 forward and backward (interval-16 delayed scaling), both Adam "
           "moments in FP8 (E4M3, E5M2, rounded stochastically), gradient clipping required",
           _fp8(Scaling("e4m3", **_NANOTRON), Scaling("e4m3"), Scaling("e5m2", **_NANOTRON)),
           optim=StatePrecision(exp_avg="e4m3", exp_avg_sq="e5m2", rounding="stochastic"), needs_grad_clip=True),
    Recipe("fp4", "FP4 training (Wang et al. 2025): E2M1 weights (per channel, DGE k=5) and activations (per token, "
           "OCC alpha 0.99), E4M3 gradients, FP8 weight gradients and first moment, FP16 second moment",
           _FP4, optim=_FP4_OPTIM),
    Recipe("fp4-weights-only", "fp4 with FP8 (E4M3, per token) activations: E2M1 weights with DGE only",
           replace(_FP4, input=Scaling("e4m3", "row"), occ=None), optim=_FP4_OPTIM),
    Recipe("fp4-no-dge", "fp4 ablation: straight-through weight gradients", replace(_FP4, dge=None), optim=_FP4_OPTIM),
    Recipe("fp4-no-occ", "fp4 ablation: no outlier clamping or compensation", replace(_FP4, occ=None),
           optim=_FP4_OPTIM),
    Recipe("fp8-rowwise", "FP8 with a scale per row (token / output channel), E4M3 throughout (torchao rowwise)",
           _fp8(Scaling("e4m3", "row"), Scaling("e4m3", "row"), Scaling("e4m3", "row"))),
    Recipe("fp8-blockwise", "DeepSeek-V3 FP8: 1x128 activation and gradient tiles, 128x128 weight blocks, "
           "power-of-two scales", _fp8(Scaling("e4m3", "block", (1, 128), pow2=True),
                                       Scaling("e4m3", "block", (128, 128), pow2=True),
                                       Scaling("e4m3", "block", (1, 128), pow2=True))),
    Recipe("mxfp8", "OCP MXFP8: E4M3 elements, one E8M0 scale per 32 along the reduction dimension",
           _fp8(Scaling("e4m3", "mx"), Scaling("e4m3", "mx"), Scaling("e4m3", "mx"))),
]}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise LowbitError(f"recipe: {name!r} is not one of {', '.join(RECIPES)}")
    return RECIPES[name]


def with_filters(recipe: Recipe, **filters) -> Recipe:
    """The recipe with its module filters (keep_lm_head, keep_first_last, min_dim, keep) overridden; `keep` may be
    given as numerics.keep's text (`keep_patterns`)."""
    if isinstance(filters.get("keep"), str):
        filters["keep"] = keep_patterns(filters["keep"])
    return replace(recipe, **{k: v for k, v in filters.items() if v is not None})


def with_dge(recipe: Recipe, k: float | None = None, clamp: float | None = None) -> Recipe:
    """The recipe with its DGE's k and clamp overridden where given (numerics.dge_k, numerics.dge_clamp)."""
    over = {key: v for key, v in (("k", k), ("clamp", clamp)) if v is not None}
    if not over:
        return recipe
    if recipe.linear is None or recipe.linear.dge is None:
        keys = ", ".join(f"numerics.dge_{key}" for key in over)
        have = ", ".join(name for name, r in RECIPES.items() if r.linear is not None and r.linear.dge is not None)
        raise LowbitError(f"{keys}: recipe {recipe.name} has no DGE ({have} have)")
    return replace(recipe, linear=replace(recipe.linear, dge=replace(recipe.linear.dge, **over)))


def with_occ_products(recipe: Recipe, products: str = "") -> Recipe:
    """The recipe with its OCC compensation products overridden where given (numerics.occ_products)."""
    if not products:
        return recipe
    if recipe.linear is None or recipe.linear.occ is None:
        have = ", ".join(name for name, r in RECIPES.items() if r.linear is not None and r.linear.occ is not None)
        raise LowbitError(f"numerics.occ_products: recipe {recipe.name} has no OCC ({have} have)")
    return replace(recipe, linear=replace(recipe.linear, occ=replace(recipe.linear.occ, products=products)))


def with_fprop_accum(recipe: Recipe, accum: str = "") -> Recipe:
    """The recipe with its forward GEMMs' FP8 accumulation overridden where given (numerics.fprop_accum): fast
    skips Hopper's periodic promotion of partial sums to fp32."""
    if not accum:
        return recipe
    if recipe.linear is None:
        raise LowbitError(f"numerics.fprop_accum: recipe {recipe.name} has no low-precision linears")
    return replace(recipe, linear=replace(recipe.linear, fast_accum_fprop=accum == "fast"))


def with_scaling(recipe: Recipe, strategy: str = "", history: int | None = None, interval: int | None = None,
                 margin: int | None = None) -> Recipe:
    """The recipe with the scaling of its linears' GEMM operands (input, weight, grad_output) overridden where
    given: numerics.scaling (the strategy of every operand), numerics.history and numerics.interval (of the
    delayed ones), numerics.margin (of every one). The ablation knobs of nanotron and FP8-LM."""
    given = {k: v for k, v in (("scaling", strategy), ("history", history), ("interval", interval),
                                ("margin", margin)) if v not in (None, "")}
    if not given:
        return recipe
    keys = ", ".join(f"numerics.{k}" for k in given)
    if recipe.linear is None:
        raise LowbitError(f"{keys}: recipe {recipe.name} has no low-precision linears to scale")
    if margin is not None and margin < 0:
        raise LowbitError(f"numerics.margin: must be >= 0, got {margin}")
    lin = recipe.linear
    operands = {"input": lin.input, "weight": lin.weight, "grad_output": lin.grad_output}
    out = {}
    for name, s in operands.items():
        if strategy == "delayed" and s.granularity != "tensor":
            raise LowbitError(f"numerics.scaling: delayed needs one scale per tensor; recipe {recipe.name} scales "
                              f"its {name} per {s.granularity}")
        s = replace(s, strategy=strategy or s.strategy)
        if s.strategy == "delayed":
            s = replace(s, history=history or s.history, interval=interval or s.interval)
        out[name] = replace(s, margin=s.margin if margin is None else margin)
    if (history or interval) and not any(s.strategy == "delayed" for s in out.values()):
        which = ", ".join(f"numerics.{k}" for k in ("history", "interval") if given.get(k))
        raise LowbitError(f"{which}: recipe {recipe.name} has no delayed scaling (add numerics.scaling=delayed)")
    return replace(recipe, linear=replace(lin, **out))


@dataclass(frozen=True)
class Tree:
    """What the module filters know of a model, found by its structure rather than by names, so that they work on
    any module tree (lowbit's Llama, HF's LlamaForCausalLM, a user's own): the repeated blocks and the output head."""

    blocks: str | None  # prefix of the blocks' names ("layers.", "model.layers."); None: no repeated blocks found
    edges: tuple[str, ...]  # prefixes of the first and last block
    heads: frozenset[str]  # linears outside the blocks onto the vocabulary (the output head)


def find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(name, length) of the container of the model's repeated blocks: of the nn.ModuleList and nn.Sequential
    whose children are all of one type (pipeline placeholders, nn.Identity, aside), the one holding the most
    parameters; a list of experts or heads inside a block holds fewer than the list of blocks. None if none."""
    best, most = None, -1
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0:
            continue
        kinds = {type(c) for c in m if type(c) is not nn.Identity}
        size = sum(p.numel() for p in m.parameters())
        if len(kinds) == 1 and size > most:
            best, most = (name, len(m)), size
    return best


def model_tree(model: nn.Module) -> Tree:
    """The model's blocks (`find_blocks`), the prefixes of its first and last, and its output heads."""
    found = find_blocks(model)
    prefix = None if found is None else (f"{found[0]}." if found[0] else "")
    edges = () if found is None else (f"{prefix}0.", f"{prefix}{found[1] - 1}.")
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    inside = (lambda name: False) if prefix is None else (lambda name: name.startswith(prefix))
    heads = frozenset(name for name, m in model.named_modules() if isinstance(m, nn.Linear) and (
        name in ("output", "lm_head") or (m.out_features in vocab and not inside(name))))
    return Tree(prefix, edges, heads)


def _kept(name: str, linear: nn.Linear, recipe: Recipe, tree: Tree) -> str | None:
    """Why `name` stays high precision, or None to convert it."""
    if recipe.keep_lm_head and name in tree.heads:
        return "output head"
    if recipe.keep_first_last and name.startswith(tree.edges):
        return "first/last block"
    if min(linear.in_features, linear.out_features) < recipe.min_dim:
        return f"smaller than min_dim {recipe.min_dim}"
    pattern = next((k for k in recipe.keep if keep_matches(name, k)), None)
    if pattern:
        return f"keep {pattern}"
    if recipe.filter is not None and not recipe.filter(linear, name):
        return "filter"
    return None


def checked_tree(model: nn.Module, recipe: Recipe) -> Tree:
    """The model's Tree, with the recipe's filters checked against it: a filter that can find nothing is an
    error, not a silent no-op."""
    tree = model_tree(model)
    if recipe.keep_first_last and tree.blocks is None:
        raise LowbitError("keep_first_last: this model has no repeated blocks to find the first and last of (an "
                          "nn.ModuleList or nn.Sequential of modules of one type)")
    check_keep(model, recipe.keep)
    return tree


def keep_patterns(text: str) -> tuple[str, ...]:
    """numerics.keep's patterns: separated by commas, or by semicolons (a `lowbit compare` variant cannot hold a
    comma), each once, in order."""
    return tuple(dict.fromkeys(k.strip() for k in text.replace(";", ",").split(",") if k.strip()))


def keep_matches(name: str, pattern: str) -> bool:
    """A glob over the whole name ("layers.0.*", "*.attention.w?"), or without glob characters the name's last
    dotted parts ("w2", "feed_forward.w2")."""
    if any(c in pattern for c in "*?["):
        return fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def check_keep(model: nn.Module, keep: tuple[str, ...]) -> None:
    """Each `keep` pattern must name at least one linear: a typo would otherwise convert everything silently."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    example = names[0] if names else "none"
    for k in keep:
        if not any(keep_matches(n, k) for n in names):
            raise LowbitError(f"numerics.keep: {k!r} matches no linear of this model (names look like "
                              f"{example!r}; give a name's ending such as 'w2' or 'attention.wo', or a glob over "
                              f"the whole name such as 'layers.0.*' or '*.feed_forward.*')")


def covered_linears(model: nn.Module, recipe: Recipe) -> list[str]:
    """Names of the linears the recipe covers: the converted ones, or for a recipe without low-precision linears
    (bf16) the ones its filters would convert. Their weights get the recipe's optimizer precision."""
    tree = model_tree(model) if recipe.linear is None else None
    return [name for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)
            or (tree is not None and type(m) is nn.Linear and _kept(name, m, recipe, tree) is None)]


def param_groups(model: nn.Module, recipe: Recipe, precision: StatePrecision | None = None) -> list[dict]:
    """LowbitAdamW's parameter groups: the weights of the linears the recipe covers with its optimizer storage
    (`precision`, by default the recipe's), everything else in the default (fp32) one. Empty groups are left out."""
    covered = {id(model.get_submodule(name).weight) for name in covered_linears(model, recipe)}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) in covered], "precision": precision or recipe.optim,
               "covered": True},
              {"params": [p for p in params if id(p) not in covered]}]
    return [g for g in groups if g["params"]]


def is_fp8(recipe: Recipe) -> bool:
    """The recipe's linears compute in FP8 (E4M3/E5M2 operands): what numerics.fp8_attention goes with."""
    lin = recipe.linear
    return lin is not None and all(s.format.name in ("e4m3", "e5m2") for s in (lin.input, lin.weight,
                                                                              lin.grad_output))


def convert(model: nn.Module, recipe: Recipe) -> dict[str, list[str]]:
    """Swap eligible nn.Linear modules of `model` (in place) for LowPrecisionLinear with the recipe's numerics.
    Returns {"converted": [names], "kept": ["name (reason)"]} (and "compressed": the modules whose saved
    activations the recipe stores compressed; "fp8_attention": the attention cores swapped for FP8 ones; with
    `fused_producers`, "fused" and "unfused": install_fused_producers'). Embeddings are not linears and stay as they
    are."""
    report = {"converted": [], "kept": []}
    tree = checked_tree(model, recipe)
    if recipe.saved_activations is not None:
        # keep_first_last: the edge blocks, and what lies outside the blocks (the final norm), stay exact
        skip = (lambda name: name.startswith(tree.edges) or not name.startswith(tree.blocks)) \
            if recipe.keep_first_last else (lambda name: False)
        report["compressed"] = compress_saved_activations(model, recipe.saved_activations, skip)
    if recipe.fp8_attention:
        if not is_fp8(recipe):
            raise LowbitError(f"fp8_attention: recipe {recipe.name} has no FP8 linears (an FP8 recipe such as "
                              f"fp8-tensorwise)")
        report["fp8_attention"] = swap_attention(model)
    if recipe.linear is None:
        return report
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    reasons = {name: _kept(name, m, recipe, tree) for name, m in linears}  # the user's filter called once each
    lin = recipe.linear
    if "e2m1" in (lin.input.format.name, lin.weight.format.name, lin.grad_output.format.name):
        for name, m in linears:  # every layer checked before any is swapped
            if reasons[name] is None:
                check_fp4_dims(name, m.in_features, m.out_features)
    for name, module in linears:
        if reasons[name]:
            report["kept"].append(f"{name} ({reasons[name]})")
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LowPrecisionLinear.from_linear(module, recipe.linear))
        report["converted"].append(name)
    if recipe.fused_producers:  # after the codecs: the fused modules keep the codec of the modules they replace
        report.update(install_fused_producers(model))
    return report
