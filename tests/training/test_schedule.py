"""Tests for seq2seq.training.schedule: the multipliers, their state in checkpoints, the clock's share.
(Each update's rate in a whole run, and in a resumed one: tests/training/test_fit.py.)"""

import io
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer

from seq2seq.training.schedule import LinearToZero, inverse_sqrt_schedule, linear_schedule, time_spent


def test_inverse_sqrt_schedule():
    assert inverse_sqrt_schedule(0, warmup_steps=4) == 0.25
    assert inverse_sqrt_schedule(3, warmup_steps=4) == 1.0  # the peak, at the 4th update
    assert inverse_sqrt_schedule(15, warmup_steps=4) == pytest.approx(0.5)  # sqrt(4/16)


def test_linear_schedule_warms_up_then_falls_to_zero_at_the_end_of_the_budget():
    assert linear_schedule(0, warmup_steps=4, progress=0.0) == 0.25
    assert linear_schedule(3, warmup_steps=4, progress=0.0) == 1.0
    assert linear_schedule(3, warmup_steps=4, progress=0.1) == pytest.approx(0.9)  # the lower of the two lines
    assert linear_schedule(1, warmup_steps=4, progress=0.9) == pytest.approx(0.1)  # a short budget cuts warm-up
    assert linear_schedule(50, warmup_steps=4, progress=1.0) == 0.0
    assert linear_schedule(50, warmup_steps=4, progress=1.2) == 0.0  # never negative


def test_linear_to_zero_follows_updates_or_time_whichever_is_further():
    multiplier = LinearToZero(warmup_steps=2)
    assert multiplier(10) == 1.0  # no budget known yet: the peak
    multiplier.budget_steps = 40
    assert multiplier(10) == pytest.approx(0.75)
    multiplier.time_spent = 0.5
    assert multiplier(10) == pytest.approx(0.5)  # the clock is further on than the updates
    assert multiplier(30) == pytest.approx(0.25)
    assert multiplier(40) == 0.0 and multiplier(41) == 0.0


def test_linear_to_zero_state_is_plain_data_and_is_restored():
    """LambdaLR saves the multiplier's attributes in the checkpoint, which must load with weights_only=True."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    multiplier = LinearToZero(warmup_steps=2)
    multiplier.budget_steps, multiplier.time_spent = 40.0, 0.25
    schedule = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([parameter], lr=1.0), multiplier)
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    buffer.seek(0)
    fresh = LinearToZero(warmup_steps=2)
    torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([parameter], lr=1.0), fresh).load_state_dict(
        torch.load(buffer, weights_only=True))
    assert (fresh.budget_steps, fresh.time_spent) == (40.0, 0.25)


def test_time_spent_is_the_share_of_max_time_and_is_broadcast():
    timer = Timer(duration="00:00:02:00")
    timer.load_state_dict({"time_elapsed": {"train": 30.0}})  # a resumed run: 30 s already spent
    broadcast = []
    strategy = SimpleNamespace(broadcast=lambda value: broadcast.append(value) or value)
    assert time_spent(SimpleNamespace(callbacks=[timer], strategy=strategy)) == pytest.approx(0.25)
    assert broadcast == [pytest.approx(0.25)]  # rank 0's value is what every rank uses
    timer.load_state_dict({"time_elapsed": {"train": 500.0}})
    assert time_spent(SimpleNamespace(callbacks=[timer], strategy=strategy)) == 1.0
    assert time_spent(SimpleNamespace(callbacks=[Timer(duration=None)], strategy=strategy)) == 0.0  # no max_time
