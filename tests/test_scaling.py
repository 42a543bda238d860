"""Scaling: granularities, current and delayed strategies (hand-made amax sequences), margin, power-of-two,
bad amaxes, and the state in buffers."""

import math

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.numerics.linear import LinearRecipe, LowPrecisionLinear
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling, expand_groups, group_amax, scale_from_amax
from lowbit.numerics.scaling_state import OperandStates, ScalingState

E4M3_MAX = 448.0


def run_sequence(spec: Scaling, amaxes: list[float]) -> list[float]:
    """The scale each step's cast used, feeding tensors whose amax is the given value."""
    state = ScalingState(spec)
    used = []
    for a in amaxes:
        used.append(state.scales_for(torch.tensor([a, -a / 2]), update=True).item())
    return used


def test_current_scaling_uses_this_tensors_amax():
    assert run_sequence(Scaling("e4m3"), [2.0, 8.0, 0.5]) == [224.0, 56.0, 896.0]


def test_delayed_rolling_window_max():
    # TransformerEngine semantics: step t casts with the scale from the window of steps < t; the first step,
    # with no history, with its own amax.
    spec = Scaling("e4m3", strategy="delayed", history=3, algo="max")
    used = run_sequence(spec, [2.0, 8.0, 1.0, 1.0, 1.0, 4.0])
    want = [E4M3_MAX / 2, E4M3_MAX / 2, E4M3_MAX / 8, E4M3_MAX / 8, E4M3_MAX / 8, E4M3_MAX / 1]
    assert used == pytest.approx(want)  # the 8.0 leaves the window of 3 after three more steps


def test_delayed_most_recent():
    spec = Scaling("e4m3", strategy="delayed", history=16, algo="most_recent")
    assert run_sequence(spec, [2.0, 8.0, 1.0, 4.0]) == pytest.approx([224.0, 224.0, 56.0, 448.0])


def test_delayed_interval_recomputes_every_n_steps():
    # nanotron semantics: the amax is recorded every step, the scale recomputed once every `interval` updates
    spec = Scaling("e4m3", strategy="delayed", history=16, algo="max", interval=3)
    used = run_sequence(spec, [2.0, 8.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    # first cast: its own amax; update 1 sets a scale (2), update 2 does not; update 3: max(2, 8, 4) = 8
    assert used == pytest.approx([224.0, 224.0, 224.0, 56.0, 56.0, 56.0, 56.0])
    spec = Scaling("e4m3", strategy="delayed", history=2, algo="max", interval=3)
    used = run_sequence(spec, [2.0, 8.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    assert used == pytest.approx([224.0, 224.0, 224.0, 56.0, 56.0, 56.0, 448.0])  # window of 2 at 6: (1, 1)


def test_delayed_warmup_casts_with_the_current_amax_first_and_after_a_bad_one():
    """MS-AMP's warm-up (the fp8lm recipes, warmup 16): the current amax for the first `warmup` casts, the window
    after them, and the current amax again for `warmup` casts after a non-finite one."""
    spec = Scaling("e4m3", strategy="delayed", history=4, algo="max", warmup=3)
    seq = [2.0, 8.0, 1.0, 1.0, 1.0, float("inf"), 4.0, 2.0, 1.0, 1.0]
    used = run_sequence(spec, seq)
    own = [E4M3_MAX / a for a in seq]
    assert used[:3] == pytest.approx(own[:3])  # warm-up: each its own amax
    assert used[3:5] == pytest.approx([E4M3_MAX / 8] * 2)  # the window (8 is still in it)
    # the Inf itself casts with the window's scale (a bad current amax keeps the previous scale) and opens a
    # warm-up of 3 casts while it is among the last 3 recorded
    assert used[6:9] == pytest.approx(own[6:9])
    assert used[9] == pytest.approx(E4M3_MAX / 4)  # the window again: max(4, 2, 1) of the last 4 (the Inf is 0)
    no_warmup = run_sequence(Scaling("e4m3", strategy="delayed", history=4, algo="max"), seq)
    assert no_warmup[1] == pytest.approx(E4M3_MAX / 2) and no_warmup[6] == pytest.approx(E4M3_MAX / 1)
    assert "warmup=16" in repr(ScalingState(Scaling("e4m3", strategy="delayed", warmup=16)))


def test_fp8lm_recipes_warm_up_their_delayed_operands():
    from lowbit.numerics.recipes import get_recipe

    for name in ("fp8lm", "fp8lm-o1", "fp8lm-o2", "fp8lm-o3"):
        lin = get_recipe(name).linear
        assert lin.input.warmup == lin.grad_output.warmup == 16 and lin.weight.strategy == "current"


def test_margin_and_power_of_two():
    amax = torch.tensor(3.0)
    plain, _ = scale_from_amax(amax, Scaling("e4m3"))
    assert plain.item() == pytest.approx(E4M3_MAX / 3)
    assert scale_from_amax(amax, Scaling("e4m3", margin=2))[0].item() == pytest.approx(E4M3_MAX / 3 / 4)
    p2 = scale_from_amax(amax, Scaling("e4m3", pow2=True))[0].item()
    assert p2 == 128.0  # 2^floor(log2(149.33))
    assert scale_from_amax(amax, Scaling("e4m3", pow2=True, margin=1))[0].item() == 64.0
    assert scale_from_amax(amax, Scaling("e4m3", "mx"))[0].item() == 128.0  # MX scales are always powers of two


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_bad_amax_is_counted_and_keeps_the_state_scale(bad):
    for spec in (Scaling("e4m3"), Scaling("e4m3", strategy="delayed", history=4)):
        state = ScalingState(spec)
        state.scales_for(torch.tensor([2.0]), update=True)
        if spec.strategy == "delayed":
            state.scales_for(torch.tensor([2.0]), update=True)
        before = state.scale.item()
        x = torch.tensor([bad, 0.5]) if bad else torch.zeros(2)
        used = state.scales_for(x, update=True).item()
        assert state.scale.item() == before and state.skipped.item() == 1
        if spec.strategy == "delayed":
            assert used == before
        else:  # current: 1, whatever came before
            assert used == 1.0 and ScalingState(spec).scales_for(x, update=False) == used


def test_current_scale_of_a_bad_row_is_1_and_the_others_their_own():
    x = torch.tensor([[math.inf, 2.0], [math.nan, math.nan], [0.0, 0.0], [1.0, -4.0]])
    used = ScalingState(Scaling("e4m3", "row")).scales_for(x, update=False)
    assert used.flatten().tolist() == [1.0, 1.0, 1.0, 112.0]


def test_bad_amaxes_per_group_get_the_fallback_and_good_ones_a_finite_scale():
    amax = torch.tensor([[0.0], [-0.0], [math.nan], [math.inf], [-math.inf], [1e-45], [448.0]])
    scale, bad = scale_from_amax(amax, Scaling("e4m3", "row"), fallback=torch.tensor(3.0))
    assert bad.view(-1).tolist() == [True, True, True, True, True, False, False]
    assert scale.view(-1).tolist()[:5] == [3.0] * 5 and scale[5].item() == torch.finfo(torch.float32).max
    assert scale[6].item() == 1.0


def test_amax_of_low_precision_input_is_fp32_and_exact():
    x = (torch.randn(64, 96) * 100).bfloat16()
    x[5, 7] = math.nan
    for spec in (Scaling("e4m3"), Scaling("e4m3", "row"), Scaling("e4m3", "block", (32, 32))):
        amax = group_amax(x, spec)
        assert amax.dtype == torch.float32
        ref = group_amax(x.float(), spec)
        assert torch.equal(amax.isnan(), ref.isnan()) and torch.equal(amax.nan_to_num(), ref.nan_to_num())


def test_granularity_shapes_and_padding():
    x = torch.arange(1, 5 * 300 + 1, dtype=torch.float32).view(5, 300)
    assert group_amax(x, Scaling("e4m3")).shape == ()
    assert group_amax(x, Scaling("e4m3", "row")).shape == (5, 1)
    assert group_amax(x, Scaling("e4m3", "column")).shape == (1, 300)
    blocks = group_amax(x, Scaling("e4m3", "block", (2, 128)))
    assert blocks.shape == (3, 3)  # 5 rows -> 3 tiles of 2, 300 cols -> 3 tiles of 128 (zero padded)
    assert blocks[2, 2].item() == x[4, 256:].max().item()
    mx = group_amax(x, Scaling("e4m3", "mx"))
    assert mx.shape == (5, 10)
    assert expand_groups(blocks, Scaling("e4m3", "block", (2, 128)), x.shape).shape == x.shape


def test_mx_scales_are_e8m0_exact():
    torch.manual_seed(0)
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 256)
    q = quantize(x, Scaling("e4m3", "mx"))
    assert torch.equal(torch.exp2(torch.log2(q.scale_inv).round()), q.scale_inv)
    rel = ((q.dequantize() - x).abs() / x.abs()).max().item()
    assert rel <= 2 ** -4 + 1e-6  # E4M3: half an ulp of 3 mantissa bits; no block underflows


@pytest.mark.parametrize("kw,match", [
    (dict(fmt="e8m0"), "e8m0"),
    (dict(fmt="e9m9"), "e9m9"),
    (dict(granularity="diagonal"), "granularity"),
    (dict(granularity="row", strategy="delayed"), "delayed scaling needs tensor"),
    (dict(strategy="sometimes"), "strategy"),
    (dict(strategy="delayed", algo="median"), "algo"),
    (dict(granularity="block", block=(0, 128)), "block"),
])
def test_impossible_combinations_are_errors(kw, match):
    with pytest.raises(LowbitError, match=match):
        Scaling(**kw)


def test_state_survives_state_dict_round_trip():
    recipe = LinearRecipe(Scaling("e4m3", strategy="delayed", history=8), Scaling("e4m3"),
                          Scaling("e5m2", strategy="delayed", history=8))
    a = LowPrecisionLinear(64, 32, recipe=recipe)
    for _ in range(3):
        a(torch.randn(4, 64)).sum().backward()
    sd = a.state_dict()
    assert {"scaling.input.amax_history", "scaling.grad_output.scale", "scaling.weight.skipped"} <= set(sd)
    b = LowPrecisionLinear(64, 32, recipe=recipe)
    b.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(b.state_dict()[k], v)
    assert b.scaling["input"].updates.item() == 3


def test_a_copied_layer_records_its_own_backward():
    """The gradient sink's hook belongs to one layer's states; a deep copy gets a fresh sink whose hook records
    into the copy (before, the copied sink had no hook and the copy's output-gradient state never moved)."""
    import copy

    from lowbit.numerics.recipes import get_recipe

    layer = LowPrecisionLinear.from_linear(torch.nn.Linear(32, 16, bias=False), get_recipe("fp8-tensorwise").linear)
    twin = copy.deepcopy(layer)
    twin(torch.randn(8, 32)).sum().backward()
    assert twin.scaling["grad_output"].updates.item() == 1
    assert layer.scaling["grad_output"].updates.item() == 0


@pytest.mark.parametrize("spec", [Scaling("e5m2", strategy="delayed", history=4, interval=2),
                                  Scaling("e5m2", strategy="delayed", history=3, algo="most_recent", pow2=True),
                                  Scaling("e5m2"), Scaling("e4m3", "row")])
def test_backward_reports_are_recorded_together_as_one_at_a_time(spec):
    """The sinks' reports wait for the end of the backward pass and are then recorded in one batch: the states
    come out as recording each report on its own does, bad amaxes included."""
    import copy

    layer = OperandStates({name: ScalingState(spec) for name in "abc"})
    states = list(layer.values())
    refs = copy.deepcopy(states)
    amaxes = [[2.0, 0.5, 8.0], [4.0, 0.0, 1.0], [float("nan"), 3.0, 0.25], [1.0, 2.0, float("inf")], [0.5, 6, 7]]
    for step, amax in enumerate(amaxes):
        reports = [torch.tensor([a, float(step % 2)]) for a in amax]
        (layer.sink(torch.device("cpu")) * torch.stack(reports)).sum().backward()  # the reports are its gradient
        for ref, r in zip(refs, reports):
            ref.observe(r[0], r[1])
        for st, ref in zip(states, refs):
            for name, buf in ref.state_dict().items():
                torch.testing.assert_close(st.state_dict()[name], buf, rtol=0, atol=0, equal_nan=True,
                                           msg=f"{step} {name}")
    # delayed counts the bad amax (0.0), current the reported bad groups (1 at odd steps)
    assert all(st.updates.item() == 5 for st in states)
    assert states[1].skipped.item() == (1 if spec.strategy == "delayed" else 2)


def test_operand_states_without_operands_build_and_move():
    assert len(OperandStates({}).to("cpu")) == 0  # nothing scaled: no sink to make


def test_reports_left_by_a_raising_backward_are_recorded_in_order_with_the_next():
    """A backward that raises never reaches its end: its reports wait and are recorded, before the next pass's
    reports of the same state, when that pass ends."""
    import copy

    from conftest import RaiseInBackward

    st = ScalingState(Scaling("e5m2", strategy="delayed", history=4))
    ref = copy.deepcopy(st)
    sink = OperandStates({"grad_output": st}).sink(torch.device("cpu"))
    first, second = torch.tensor([[float("nan"), 0.0]]), torch.tensor([[3.0, 0.0]])
    loss = RaiseInBackward.apply(torch.ones(1, requires_grad=True)).sum() + (sink * first).sum()
    with pytest.raises(RuntimeError, match="raised in backward"):
        loss.backward()
    (sink * second).sum().backward()
    for r in (first[0], second[0]):
        ref.observe(r[0], r[1])
    assert st.updates.item() == 2 and st.skipped.item() == 1
    for name, buf in ref.state_dict().items():
        torch.testing.assert_close(st.state_dict()[name], buf, rtol=0, atol=0, equal_nan=True)


def test_held_reports_wait_for_the_outermost_block_then_are_recorded_in_order():
    """Within `reports_held`, backward passes leave their reports queued; the outermost block's exit records them,
    in order, as if each pass had recorded its own (the trainer's step over micro-batches)."""
    import copy

    from lowbit.numerics.scaling_state import reports_held

    st = ScalingState(Scaling("e4m3", strategy="delayed", history=4))
    ref = copy.deepcopy(st)
    sink = OperandStates({"input": st}).sink(torch.device("cpu"))
    reports = [torch.tensor([[2.0, 0.0]]), torch.tensor([[8.0, 0.0]]), torch.tensor([[4.0, 0.0]])]
    with reports_held():
        with reports_held():
            (sink * reports[0]).sum().backward()
        assert st.updates.item() == 0  # an inner block's exit records nothing
        for r in reports[1:]:
            (sink * r).sum().backward()
            assert st.updates.item() == 0 and st.scale.item() == 1
    for r in reports:
        ref.observe(r[0, 0], r[0, 1])
    assert st.updates.item() == 3
    for name, buf in ref.state_dict().items():
        torch.testing.assert_close(st.state_dict()[name], buf, rtol=0, atol=0)
