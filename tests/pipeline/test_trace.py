"""A real step's timeline: its measured in-flight counts equal the simulator's, the activation
ledger grows with m under GPipe and not under 1F1B, and the Perfetto file holds both timelines."""

import json

import pytest
from pipeline_cases import traced_step_on_rank
from pluribus.parallel import pipeline as pp
from pluribus.parallel.pipeline.simulator import Event
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_measured_timeline_matches_the_program_and_writes_a_perfetto_file(tmp_path):
    p, m = 4, 6
    results = run_ranks(traced_step_on_rank, p, args=("1F1B", m), timeout=60)
    events, _, _, program = results[0]
    assert all(r[0] == events for r in results)  # gathered on every rank
    run = pp.measured(events)
    predicted = pp.simulate(program, pp.action_costs(events))
    assert run.peak_in_flight == predicted.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert all(0 < b <= run.step_time for b in run.busy)
    assert 0 < run.bubble < 1 and 0 < predicted.bubble < 1
    # with each action's own time, the simulator can only be early: a real receive waits at
    # least as long as the model's (no latency), and everything else takes what it took
    exact = pp.simulate(program, pp.action_costs(events, per_action=True))
    assert exact.step_time <= run.step_time * (1 + 1e-9)
    assert exact.busy == pytest.approx(run.busy)
    assert 0 <= pp.message_latency(events, program) < run.step_time
    # each rank ran exactly its program, in order
    for rank in range(p):
        ran = [e.action for e in sorted(events, key=lambda e: e.start) if e.rank == rank]
        assert ran == program.actions[rank]
    path = pp.write_trace(
        tmp_path / "trace.json", {"measured": events, "predicted": predicted.events}
    )
    trace = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {f"{w} rank {r}" for w in ("measured", "predicted") for r in range(p)}
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == 2 * sum(len(a) for a in program.actions)
    assert {e["name"] for e in spans} >= {"0F0", "3B5", "1SEND_B0", "2RECV_F5"}


def test_a_zbv_run_holds_what_the_simulator_says_and_runs_its_program_in_order():
    p, m = 2, 5
    events, _, _, program = run_ranks(traced_step_on_rank, p, args=("ZBV", m), timeout=60)[0]
    assert program.stages_of(0) == [0, 3] and program.stages_of(1) == [1, 2]
    run = pp.measured(events)
    assert run.peak_in_flight == pp.simulate(program).peak_in_flight == [2 * p] * p
    for rank in range(p):
        ran = [e.action for e in sorted(events, key=lambda e: e.start) if e.rank == rank]
        assert ran == program.actions[rank]


def test_a_zb_h2_run_warms_up_with_2p_minus_1_forwards_and_runs_its_program_in_order():
    p, m = 4, 8
    results = run_ranks(traced_step_on_rank, p, args=("ZBH2", m), timeout=60)
    events, _, _, program = results[0]
    run = pp.measured(events)
    assert run.peak_in_flight == pp.simulate(program).peak_in_flight == [7, 5, 3, 1]
    assert [r[1] for r in results] == [7, 5, 3, 1]  # the stages' own activation ledgers
    for rank in range(p):
        ran = [e.action for e in sorted(events, key=lambda e: e.start) if e.rank == rank]
        assert ran == program.actions[rank]


@pytest.mark.parametrize("m", [2, 8])
def test_activation_ledger_1f1b_stays_at_p_while_gpipe_grows_with_m(m):
    p = 2
    gpipe = run_ranks(traced_step_on_rank, p, args=("GPipe", m), timeout=60)
    one_f = run_ranks(traced_step_on_rank, p, args=("1F1B", m), timeout=60)
    assert [r[1] for r in gpipe] == [m, m]
    assert [r[1] for r in one_f] == [min(p, m), 1]
    # bytes: every micro-batch holds the same activations
    for rank in range(p):
        assert gpipe[rank][2] == m * one_f[rank][2] / min(p - rank, m)


def test_each_messages_own_latency_is_read_from_a_run_and_replayed_by_the_simulator():
    """GPipe on 2 ranks, 1 micro-batch, unit costs, as the runtime records it (a receive spans
    its wait): the activation takes 3 after its send, the gradient 0.5. Each message's own
    latency gives back the run's step; the one median latency does not."""
    program = pp.build("GPipe", 2, 1)
    timeline = {
        0: [("0F0", 0, 1), ("0SEND_F0", 1, 1), ("0RECV_B0", 1, 7.5), ("0B0", 7.5, 9.5)],
        1: [("1RECV_F0", 0, 4), ("1F0", 4, 5), ("1B0", 5, 7), ("1SEND_B0", 7, 7)],
    }
    events = [
        Event(rank, pp.Action.parse(a), start, end)
        for rank, actions in timeline.items()
        for a, start, end in actions
    ]
    assert [e.action for e in events if e.rank == 1] == program.actions[1]
    each = pp.message_latency(events, program, per_message=True)
    receives = [a for acts in program.actions for a in acts if a.kind.startswith("RECV")]
    assert {str(a): each(a) for a in receives} == {"1RECV_F0": 3.0, "0RECV_B0": 0.5}
    assert pp.message_latency(events, program) == 1.75  # the median of the two
    assert pp.measured(events).step_time == 9.5
    assert pp.simulate(program, comm=each).step_time == 9.5
    assert pp.simulate(program, comm=1.75).step_time == 9.5 - 3.0 - 0.5 + 2 * 1.75
