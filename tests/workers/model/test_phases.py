"""The phase recorder: what a step's spans add up to, that a step records each phase where it
happens, and that recording changes no result (the model's arithmetic is the same with and
without it). No timing is asserted: only which phases were entered and how often."""
from __future__ import annotations

import numpy as np

from tests.hfkit import make_checkpoint
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.transformer import Model, ModelShape, SeqInput
from kvrt.workers.model.phases import ATTENTION, COPIES, LM_HEAD, PROJECTIONS, PhaseClock


class CountingClock(PhaseClock):
    """A PhaseClock that also counts the spans of each phase."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        super().add(name, seconds)
        self.spans[name] = self.spans.get(name, 0) + 1


def test_spans_sum_per_phase_and_take_starts_again():
    clock = PhaseClock()
    for name in ("a", "b", "a"):
        with clock.span(name):
            pass
    got = clock.take()
    assert set(got) == {"a", "b"} and all(v >= 0 for v in got.values())
    assert clock.take() == {}


def test_a_span_counts_even_when_its_body_raises():
    clock = PhaseClock()
    try:
        with clock.span("a"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert list(clock.take()) == ["a"]


def pool_for(model: Model, blocks: int = 8, block_size: int = 16) -> np.ndarray:
    layout = model.shape.kv_layout(block_size, model.kv_dtype.name)
    return np.zeros(layout.pool_shape(blocks), dtype=layout.dtype)


def batch() -> list[SeqInput]:
    """A prefill chunk and a decode of another sequence in one step."""
    return [SeqInput(np.arange(20, dtype=np.int32), 0, np.arange(2, dtype=np.int32)),
            SeqInput(np.array([7], np.int32), 5, np.array([4], np.int32))]


def check_recorded(model: Model, projections_per_layer: int) -> None:
    assert model.phases is None  # serving: nothing attached, nothing recorded
    plain = model.step_logits(pool_for(model), batch())
    clock = CountingClock()
    model.phases = clock
    timed = model.step_logits(pool_for(model), batch())
    layers = model.shape.num_layers
    assert clock.spans == {PROJECTIONS: projections_per_layer * layers, ATTENTION: layers, LM_HEAD: 1, COPIES: 2}
    assert set(clock.take()) == {PROJECTIONS, ATTENTION, LM_HEAD, COPIES}
    np.testing.assert_array_equal(plain, timed)


def test_reference_model_records_each_phase_of_a_step():
    # q/k/v (one matmul), o, gate/up (one), down per layer
    check_recorded(Model(ModelShape(num_layers=2, vocab_size=64, max_model_len=256)), 4)


def test_checkpoint_model_records_each_phase_of_a_step(tmp_path):
    model = HFModel(inspect(make_checkpoint(tmp_path, "Qwen2ForCausalLM", num_hidden_layers=2).path), 256)
    check_recorded(model, 4)
