"""Pipeline parallelism: a model cut into stages on different ranks, micro-batches streamed
through them by a schedule that is plain data you can print, check and simulate before running.

* :mod:`.schedules`: actions, programs and the built-in schedules (GPipe, 1F1B, interleaved
  1F1B, ZB-H1, ZB-H2, ZB-V) as per-rank action lists.
* :mod:`.checker`: proves a program completes (matched sends, no wait-for cycle).
* :mod:`.simulator`: step time, bubble and in-flight activations from per-action costs.
* :mod:`.stage` and :mod:`.runtime`: :class:`PipelineStage` and the schedule classes that
  replay a program on real ranks.
* :mod:`.split`: cut an ``nn.Sequential`` or a GPT into balanced stages.
* :mod:`.trace`: a real step's timeline, its measured bubble, and Perfetto files of it next to
  the simulator's prediction.
"""

from .checker import ScheduleError, check, execution_order, sender_of
from .runtime import (
    SCHEDULE_CLASSES,
    PipelineError,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleFromProgram,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    ScheduleZeroBubbleH2,
)
from .schedules import (
    SCHEDULES,
    Action,
    Program,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    with_communication,
    zbv,
    zero_bubble,
    zero_bubble_h2,
)
from .simulator import UNIT_COSTS, Event, Simulation, bubble_closed_form, simulate
from .split import (
    GPTEmbedding,
    GPTHead,
    balance,
    gpt_layers,
    measured_costs,
    parameter_costs,
    split_gpt,
    split_sequential,
)
from .stage import PipelineStage
from .trace import action_costs, gather_events, measured, message_latency, perfetto, write_trace

__all__ = [
    "gather_events",
    "measured",
    "message_latency",
    "action_costs",
    "perfetto",
    "write_trace",
    "GPTEmbedding",
    "GPTHead",
    "balance",
    "gpt_layers",
    "measured_costs",
    "parameter_costs",
    "split_gpt",
    "split_sequential",
    "SCHEDULE_CLASSES",
    "PipelineError",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleFromProgram",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZBVZeroBubble",
    "ScheduleZeroBubble",
    "ScheduleZeroBubbleH2",
    "SCHEDULES",
    "UNIT_COSTS",
    "Action",
    "Event",
    "Program",
    "ScheduleError",
    "Simulation",
    "bubble_closed_form",
    "build",
    "check",
    "execution_order",
    "sender_of",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "simulate",
    "with_communication",
    "zbv",
    "zero_bubble",
    "zero_bubble_h2",
]
