"""On exit every sink is closed, and the first failure is the one that propagates (issue 35 item 11)."""

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import SinkError, sinks


def test_a_failing_close_hides_no_table_failure_and_every_sink_is_closed(monkeypatch):
    model, tok = eh.zoo.load("gpt2-tiny")
    closed = []

    def table(self, step, df):
        raise RuntimeError("the table broke")

    def close(self):
        closed.append(self)
        raise OSError("the close broke")

    monkeypatch.setattr(sinks.CallableSink, "table", table)
    monkeypatch.setattr(sinks.CallableSink, "close", close)
    with pytest.raises(SinkError, match="the table broke"):
        with eh.monitor(model, sink=[lambda step, v: None, lambda step, v: None]), torch.no_grad():
            model(**tok(["def f(x):"], return_tensors="pt"))
    assert len(closed) == 2  # the second sink was closed although the first one's close failed


def test_a_failing_close_alone_is_said(monkeypatch):
    model, tok = eh.zoo.load("gpt2-tiny")

    def close(self):
        raise OSError("the close broke")

    monkeypatch.setattr(sinks.CallableSink, "close", close)
    with pytest.raises(SinkError, match="the close broke"):
        with eh.monitor(model, sink=lambda step, v: None), torch.no_grad():
            model(**tok(["def f(x):"], return_tensors="pt"))
