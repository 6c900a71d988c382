"""Logging: quiet by default, FXPASSES_LOG turns it on, progress is rate-bounded."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from fxpasses import log

SNIPPET = ("import logging, fxpasses; logging.getLogger('fxpasses.test').info('hello-info'); "
           "logging.getLogger('fxpasses').debug('hello-debug')")


def run_python(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != log.ENV_VAR}
    if env_value is not None:
        env[log.ENV_VAR] = env_value
    done = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stderr


@pytest.mark.parametrize("value, shown", [(None, []), ("info", ["hello-info"])])
def test_environment_variable_sets_the_level(value, shown):
    stderr = run_python(value)
    assert [w for w in ("hello-info", "hello-debug") if w in stderr] == shown


@pytest.fixture
def restored_logger():
    handlers, level, handler = list(log.logger.handlers), log.logger.level, log._handler
    yield log.logger
    log.logger.handlers[:] = handlers
    log.logger.setLevel(level)
    log._handler = handler


def test_enable_is_idempotent_and_filters_by_level(restored_logger):
    stream = io.StringIO()
    log.enable("WARNING", stream)
    log.enable(logging.INFO, stream)
    restored_logger.debug("below")
    restored_logger.info("above")
    assert stream.getvalue().count("above") == 1 and "below" not in stream.getvalue()


@pytest.mark.parametrize("text, level", [("INFO", 20), ("debug", 10), ("15", 15)])
def test_parse_level(text, level):
    assert log.parse_level(text) == level


def test_parse_level_rejects_a_bad_name():
    with pytest.raises(ValueError):
        log.parse_level("chatty")


def test_progress_logs_at_a_bounded_rate(caplog):
    ticks = iter(range(100))
    with caplog.at_level(logging.INFO, logger="fxpasses"):
        items = list(log.progress(range(10), what="sweep", every=3.0, clock=lambda: next(ticks)))
    assert items == list(range(10))
    done = [r.args[1] for r in caplog.records]
    assert done == [3, 6, 9, 10]  # every third tick (one clock read per item), then the end
    assert all(r.args[2] == "/10" for r in caplog.records)  # the total, from len()


def test_a_new_trace_logs_when_it_starts_and_when_it_is_done(two_branch_loss, two_branch_inputs, caplog):
    from fxpasses import optimize
    fast = optimize(two_branch_loss)
    with caplog.at_level(logging.INFO, logger="fxpasses"):
        fast(*two_branch_inputs)
        fast(*two_branch_inputs)  # the same structure: no trace, no line
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2
    assert lines[0].startswith("specialization 0 of TwoBranchLoss: tracing and running")
    assert "trace" in lines[1] and "pipeline" in lines[1] and lines[1].endswith(" s")
