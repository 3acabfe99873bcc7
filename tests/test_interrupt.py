"""Stop signals (kfac_compiler.interrupt): Ctrl-C, SIGTERM and SIGHUP end a command with the
shell's exit code for the signal, at a step boundary in training and through our `finally`
blocks elsewhere. Real signals to this process; the CLI's end-to-end behaviour is in
test_run_io.py and test_fault_injection.py."""
from __future__ import annotations

import os
import signal

import pytest

from kfac_compiler.interrupt import STOP_SIGNALS, Interrupted, StopOnInterrupt, deferred_stop, exit_code, raise_on_stop

SIGNALS = [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]


@pytest.mark.parametrize("signum,code", SIGNALS)
def test_the_exit_code_is_the_shells_for_the_signal(signum, code):
    assert exit_code(signum) == code == Interrupted(signum).exit_code


@pytest.mark.parametrize("signum,code", SIGNALS)
def test_raise_on_stop_raises_interrupted_and_restores_the_handlers(signum, code):
    before = signal.getsignal(signum)
    with pytest.raises(Interrupted) as got, raise_on_stop():
        os.kill(os.getpid(), signum)
    assert got.value.exit_code == code and isinstance(got.value, KeyboardInterrupt)
    assert signal.getsignal(signum) is before


def test_deferred_stop_finishes_the_block_then_raises_the_first_signal():
    done = []
    with pytest.raises(Interrupted) as got, deferred_stop():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        done.append(True)
    assert done == [True] and got.value.exit_code == 143


@pytest.mark.parametrize("signum,code", SIGNALS)
def test_the_first_signal_asks_to_stop_and_a_second_ends_at_once(signum, code):
    with StopOnInterrupt() as stop:
        assert not stop.requested and stop.exit_code == 130
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.exit_code == code
        with pytest.raises(Interrupted) as got:
            os.kill(os.getpid(), signal.SIGTERM)
    assert got.value.exit_code == 143
    assert stop.describe() == ("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")


def test_sigusr1_is_mpiruns_forwarded_ctrl_c():
    with StopOnInterrupt((*STOP_SIGNALS, signal.SIGUSR1)) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.exit_code == 130 and stop.describe() == "interrupted"
        with pytest.raises(Interrupted) as got:
            os.kill(os.getpid(), signal.SIGUSR1)
    assert got.value.exit_code == 130
