"""Schedules as data: the checker accepts every built-in program and rejects broken ones, and the
simulator's bubble at unit costs equals the closed forms."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pluribus.parallel.pipeline import (
    Action,
    Program,
    ScheduleError,
    bubble_closed_form,
    build,
    check,
    simulate,
)
from pluribus.parallel.pipeline.schedules import SCHEDULES

pytestmark = pytest.mark.timeout(120)


def test_checker_accepts_every_builtin_up_to_8_ranks_4_chunks_32_microbatches():
    refused = []
    for name in SCHEDULES:
        for p in range(1, 9):
            for v in range(1, 5) if name == "Interleaved1F1B" else [1]:
                for m in range(1, 33):
                    try:
                        program = build(name, p, m, v)
                    except ValueError as e:
                        refused.append((name, p, v, m))
                        assert "valid counts" in str(e)
                        continue
                    order = check(program)
                    assert len(order) == sum(len(a) for a in program.actions), (name, p, v, m)
    # only interleaved refuses, and only counts above p that are not multiples of p
    assert all(n == "Interleaved1F1B" and m > p and m % p for n, p, v, m in refused)
    assert ("Interleaved1F1B", 2, 2, 5) not in refused  # m = 2p + 1 runs at 2 and 4 ranks
    assert ("Interleaved1F1B", 4, 2, 9) not in refused


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(list(SCHEDULES)),
    p=st.integers(1, 8),
    v=st.integers(1, 4),
    m=st.integers(1, 32),
)
def test_unit_cost_bubble_equals_the_closed_form(name, p, v, m):
    if name != "Interleaved1F1B":
        v = 1
    elif m % p:
        m = p * max(1, m // p)
    sim = simulate(build(name, p, m, v))
    # unit costs are small integers, so the simulated times are exact
    measured = Fraction(sum(sim.step_time - b for b in sim.busy)) / Fraction(p * sim.step_time)
    work = {"Interleaved1F1B": v * m, "ZeroBubble": 3 * m, "ZBH2": 3 * m, "ZBV": 6 * m}.get(name, m)
    expected = Fraction(p - 1, work + p - 1)
    assert abs(bubble_closed_form(name, p, m, v) - float(expected)) < 1e-15
    if name in ("ZeroBubble", "ZBH2") and m < p:
        # too few micro-batches to fill the pipeline: better than 1F1B, not the closed form
        one_f_one_b = simulate(build("1F1B", p, m))
        assert sim.step_time <= one_f_one_b.step_time
    elif name == "ZBV" and m < 2 * p - 1:
        # too few to fill the V: no slower than ZB-H1 on the same model (stages twice as long)
        zb_h1 = simulate(build("ZeroBubble", p, m), {"F": 2, "I": 2, "W": 2})
        assert sim.step_time <= zb_h1.step_time
    else:
        assert measured == expected, (name, p, v, m, sim)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 8), m=st.integers(1, 32))
def test_activation_memory_1f1b_at_most_p_gpipe_grows_with_m(p, m):
    assert simulate(build("1F1B", p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]
    assert simulate(build("GPipe", p, m)).peak_in_flight == [m] * p
    zb = simulate(build("ZeroBubble", p, m))
    assert zb.peak_in_flight == [min(p - r, m) for r in range(p)]  # the same as 1F1B
    assert all(w <= 2 * p - r - 1 for r, w in enumerate(zb.peak_waiting_w))
    # ZB-V: 2p half-size stages' micro-batches from forward to W, 1F1B's rank 0, on every rank
    zbv_peaks = peak_before_weight_grad(build("ZBV", p, m))
    assert all(k <= min(2 * p, 2 * m) for k in zbv_peaks)
    if m >= 2 * p:
        assert zbv_peaks == [2 * p] * p


def peak_before_weight_grad(program: Program) -> list[int]:
    """Per rank, the most micro-batches (of any of its stages) between forward and W or B."""
    peaks = []
    for actions in program.actions:
        held = peak = 0
        for a in actions:
            held += {"F": 1, "W": -1, "B": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(SCHEDULES)),
    p=st.integers(2, 6),
    m=st.integers(1, 12),
    pick=st.integers(0, 10_000),
)
def test_dropping_any_send_or_receive_is_rejected(name, p, m, pick):
    v = 2 if name == "Interleaved1F1B" else 1
    m = p * max(1, m // p) if name == "Interleaved1F1B" else m
    program = build(name, p, m, v)
    comms = [(r, i) for r, acts in enumerate(program.actions) for i, a in enumerate(acts)]
    comms = [(r, i) for r, i in comms if not program.actions[r][i].is_compute]
    rank, index = comms[pick % len(comms)]
    dropped = program.actions[rank][index]
    program.actions[rank].pop(index)
    with pytest.raises(ScheduleError, match="never (receives|sends)") as info:
        check(program)
    assert f"micro-batch(es) [{dropped.microbatch}]" in str(info.value)


def test_a_receive_before_the_send_it_waits_for_is_a_named_deadlock():
    program = Program.parse(
        ["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], num_microbatches=1
    )
    with pytest.raises(ScheduleError) as info:
        check(program)
    text = str(info.value)
    assert "deadlock: ranks 0 -> 1 -> 0 wait on each other in a cycle" in text
    assert "rank 0 waits at action 0 (0RECV_B0) for rank 1's 1SEND_B0" in text
    assert "rank 1 waits at action 0 (1RECV_F0) for rank 0's 0SEND_F0" in text


def test_a_three_rank_cycle_is_found():
    # rank 0 holds stages 0 and 3 and wants stage 3's input before it has run stage 0
    ranks = ["3F0 3B0 0F0 0B0", "1F0 1B0", "2F0 2B0"]
    program = Program.parse(ranks, num_microbatches=1, stage_to_rank=(0, 1, 2, 0))
    with pytest.raises(ScheduleError, match=r"deadlock: ranks 0 -> 2 -> 1 -> 0 wait"):
        check(program)


def test_receives_in_another_order_than_the_sends_are_rejected():
    program = Program.parse(
        [
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1",
        ],
        num_microbatches=2,
    )
    with pytest.raises(ScheduleError, match=r"order \[0, 1\] but rank 1 receives them in order"):
        check(program)


def test_structural_mistakes_are_named():
    with pytest.raises(ScheduleError) as info:
        check(Program.parse(["0F0 0B0 0F1", "1F0 1B0 1B1"], num_microbatches=2))
    text = str(info.value)
    assert "rank 0 action 3 (0B0) runs before 1SEND_B0" not in text  # comms were added
    assert "stage 0 micro-batch 1: needs one B, or one I and one W; has 0 B" in text
    assert "rank 1 action" in text and "(1B1) runs before 1F1, which it needs" in text
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1, not rank 0"):
        check(Program("x", 1, (0, 1), [[Action(0, "F", 0), Action(1, "F", 0)], []]))


def test_a_user_written_zero_bubble_style_program_is_accepted_and_simulated():
    program = Program.parse(
        ["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"], num_microbatches=2
    )
    check(program)
    assert "0SEND_F0" in str(program) and "1SEND_B1" in str(program)
    sim = simulate(program, {"F": 1, "I": 1, "W": 1})
    assert sim.step_time == 7 and sim.busy == [6, 6]


def test_programs_print_as_torch_does_and_parse_back():
    program = build("1F1B", 2, 3)
    assert str(program).splitlines()[0] == "1F1B: 2 rank(s), 2 stage(s), 3 micro-batch(es)"
    assert str(program.compute_only()).splitlines()[1] == "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2"
    again = Program.parse(
        [" ".join(map(str, a)) for a in program.actions], 3, program.stage_to_rank, "1F1B"
    )
    assert again.actions == program.actions


def test_bad_sizes_say_what_is_valid():
    with pytest.raises(ValueError, match=r"5 micro-batches deadlock in the interleaved order"):
        build("Interleaved1F1B", 4, 5, 3)
    with pytest.raises(ValueError, match=r"valid counts up to 16 are 1, 2, 3, 4, 6, 7, 8, 10,"):
        build("Interleaved1F1B", 4, 5, 3)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        build("GPipe", 2, 0)
    with pytest.raises(ValueError, match="use one of GPipe, 1F1B, Interleaved1F1B, ZeroBubble"):
        build("Looping", 2, 2)


@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 16),
    f=st.floats(0.1, 5),
    i=st.floats(0.1, 5),
    w=st.floats(0.1, 5),
)
def test_zero_bubble_ordered_for_any_costs_is_valid_and_keeps_the_memory_limits(p, m, f, i, w):
    costs = {"F": f, "I": i, "W": w}
    program = build("ZeroBubble", p, m, costs=costs)
    sim = simulate(program, costs)  # runs the checker
    assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert all(k <= 2 * p - r - 1 for r, k in enumerate(sim.peak_waiting_w))


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 8),
    extra=st.integers(0, 12),
    f=st.integers(1, 6),
    i=st.integers(1, 6),
    data=st.data(),
)
def test_zero_bubble_for_measured_costs_leaves_exactly_the_zb_h1_bubble(p, extra, f, i, data):
    """With W no longer than F and I, every rank idles (p - 1)(F + I - W): the Ws fill the rest
    of 1F1B's (p - 1)(F + I + W). Integer costs keep the simulated times exact."""
    w = data.draw(st.integers(1, min(f, i)))
    m = p + extra
    costs = {"F": f, "I": i, "W": w}
    zb = simulate(build("ZeroBubble", p, m, costs=costs), costs)
    one_f_one_b = simulate(build("1F1B", p, m), {"F": f, "B": i + w})
    assert zb.step_time == m * (f + i + w) + (p - 1) * (f + i - w)
    assert one_f_one_b.step_time == m * (f + i + w) + (p - 1) * (f + i + w)


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 8),
    m=st.integers(1, 24),
    f=st.integers(1, 6),
    i=st.integers(1, 6),
    data=st.data(),
)
def test_zbv_for_any_costs_is_valid_keeps_1f1b_memory_and_beats_zb_h1(p, m, f, i, data):
    """ZB-V ordered for integer costs (each of its stages half a 1F1B stage): the checker
    accepts it, no rank holds more than 2p micro-batches before their W, the step is never
    longer than 1F1B's on the same model, and, with W no longer than F and I and the V full
    (m >= 2p - 1), never longer than ZB-H1's exact (p - 1)(F + I - W) idle."""
    w = data.draw(st.integers(1, 6))
    costs = {"F": f, "I": i, "W": w}
    program = build("ZBV", p, m, costs=costs)
    sim = simulate(program, costs)  # runs the checker
    assert program.stage_to_rank == tuple(list(range(p)) + list(reversed(range(p))))
    assert max(peak_before_weight_grad(program)) <= 2 * p
    one_f_one_b = simulate(build("1F1B", p, m), {"F": 2 * f, "B": 2 * (i + w)})
    assert sim.step_time <= one_f_one_b.step_time
    if w <= min(f, i) and m >= 2 * p - 1:
        assert sim.step_time <= 2 * m * (f + i + w) + 2 * (p - 1) * (f + i - w)
    unit = simulate(build("ZBV", p, m), costs)
    assert sim.step_time <= unit.step_time  # the order built for the costs is kept if better


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 8),
    m=st.integers(1, 24),
    f=st.integers(1, 6),
    i=st.integers(1, 6),
    w=st.integers(1, 6),
)
def test_zb_h2_for_any_costs_is_valid_holds_2p_minus_1_and_never_trails_zb_h1(p, m, f, i, w):
    costs = {"F": f, "I": i, "W": w}
    program = build("ZBH2", p, m, costs=costs)
    sim = simulate(program, costs)  # runs the checker
    assert program.name == "ZBH2"
    assert max(peak_before_weight_grad(program)) <= min(2 * p - 1, m)
    zb_h1 = simulate(build("ZeroBubble", p, m, costs=costs), costs)
    assert sim.step_time <= zb_h1.step_time
    assert sim.step_time >= m * (f + i + w) + (p - 1) * f  # the last rank starts p - 1 F late


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 8),
    extra=st.integers(0, 12),
    i=st.integers(1, 6),
    data=st.data(),
)
def test_zb_h2_with_w_no_longer_than_f_idles_exactly_p_minus_1_max_f_and_f_plus_i_minus_2w(
    p, extra, i, data
):
    """m >= 2p and W <= F: every rank idles (p - 1) max(F, F + I - 2W), the least any step can
    when I <= 2W, against ZB-H1's (p - 1)(F + I - W). Integer costs keep the times exact."""
    f = data.draw(st.integers(1, 6))
    w = data.draw(st.integers(1, f))
    m = 2 * p + extra
    costs = {"F": f, "I": i, "W": w}
    sim = simulate(build("ZBH2", p, m, costs=costs), costs)
    assert sim.step_time == m * (f + i + w) + (p - 1) * max(f, f + i - 2 * w)
    # the order built for unit costs gets there too when W is at least half of I
    if 2 * w >= i:
        unit_order = simulate(build("ZBH2", p, m), costs)
        assert unit_order.step_time == m * (f + i + w) + (p - 1) * f


def test_zb_h2_warms_up_with_2p_minus_1_forwards_on_rank_0():
    program = build("ZBH2", 4, 8).compute_only()
    assert [str(a) for a in program.actions[0][:8]] == [f"0F{k}" for k in range(7)] + ["0I0"]
    assert [str(a) for a in program.actions[3][:3]] == ["3F0", "3I0", "3F1"]
