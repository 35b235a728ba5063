"""A Ctrl-C while the ``eigenhooks`` command is still importing (torch, transformers) is one line, not a traceback.

The package imports nothing on ``import eigenhooks`` (its public names load on first use), so ``cli``
imports this module (which runs ``install``) before its own imports bring in torch and transformers: when this process is the
command (the ``eigenhooks`` script or ``python -m eigenhooks``), it sets a SIGINT handler that says so in
one line and exits 130 at once; ``cli.main`` puts Python's own handler back as soon as it runs, so from
there on Ctrl-C is a KeyboardInterrupt that each command handles. Imported as a library, nothing
changes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130


def _is_the_command() -> bool:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    return os.path.basename(sys.argv[0] or "") == "eigenhooks" or argv[1:3] == ["-m", "eigenhooks"]


def _starting(signum, frame) -> None:
    # os._exit, not SystemExit: an import that catches BaseException (transformers' lazy imports wrap
    # what they catch) would swallow the exit and go on. Nothing was written yet: nothing to clean up.
    sys.stderr.write("eigenhooks: interrupted while starting; nothing was done\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def install() -> None:
    """Set the one-line handler, only in the command's main thread and only over Python's default one."""
    if threading.current_thread() is not threading.main_thread() or not _is_the_command():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays ignored
        signal.signal(signal.SIGINT, _starting)


def forget_interrupt() -> None:
    """Make the command's exit code its own after an interrupt it handled. CPython remembers a
    KeyboardInterrupt that escaped code a library ran through ``PyRun_*`` (pybind11's ``exec`` does),
    and at exit ends the process by SIGINT instead of the code given (130 became -2 when Ctrl-C came
    while the model loaded); an empty ``PyRun_SimpleString`` clears that memory (CPython only)."""
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")
    except (ImportError, AttributeError, OSError):
        pass


def stop(line: str = "interrupted"):
    """Say ``eigenhooks: {line}`` on stderr and exit 130, marked as said (see ``say_if_silent``)."""
    import typer

    typer.echo(f"eigenhooks: {line}", err=True)
    e = typer.Exit(EXIT_INTERRUPTED)
    e.said = True
    raise e


def say_if_silent(e: SystemExit) -> None:
    """typer turns a KeyboardInterrupt that reaches it (Ctrl-C while it parses the flags, or one a
    command did not catch) into exit 130 with nothing said: say it in one line, unless ``stop`` did."""
    from .run.checks import causes

    if e.code != EXIT_INTERRUPTED:
        return
    for x in causes(e.__context__):
        if getattr(x, "said", False):
            return
        if isinstance(x, KeyboardInterrupt):
            sys.stderr.write("eigenhooks: interrupted\n")
            return


_dropped_by = []  # the unraisable hook that ``done`` replaced, for ``end``
DELIVER_AFTER = 0.02  # seconds before a Ctrl-C caught in a destructor is raised again in the main thread
_pending: list[threading.Timer] = []  # such a Ctrl-C, not delivered yet
_pending_lock = threading.Lock()


def _deliver() -> None:
    import _thread

    with _pending_lock:  # kept pending until the command ends: raised inside a hook, it is dropped again
        if _pending:  # else the command ended first and ``undelivered`` took it
            _thread.interrupt_main()


def _keep(unraisable) -> None:
    """A Ctrl-C that lands in a destructor (``__del__``) or a weakref callback stops the command.
    CPython prints it as "Exception ignored in ..." and drops it, and the command ran on to rc 0 (seen
    here: ``eigenhooks verify`` hit it in regex's ``Group.__del__``); it goes back to the main thread
    as a KeyboardInterrupt instead, or, when the command ends before that thread runs (a loaded
    machine), ``undelivered`` says so and the command exits 130 all the same."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        # from another thread, a moment later: raised in this hook, it would be dropped again
        timer = threading.Timer(DELIVER_AFTER, _deliver)
        timer.daemon = True
        with _pending_lock:
            _pending.append(timer)
        timer.start()
    else:
        _dropped_by[-1](unraisable)


def undelivered() -> bool:
    """Whether a Ctrl-C was caught in a destructor during the command (raised again in the main thread
    or not: it may have landed in another hook and been dropped again); it is then taken here, never
    raised later, and a command that ended 0 exits 130."""
    with _pending_lock:
        for t in _pending:
            t.cancel()
        found = bool(_pending)
        _pending.clear()
    return found


def end() -> None:
    """The command is over: the unraisable hook it found back, and its exit code its own."""
    if _dropped_by and sys.unraisablehook is _keep:
        sys.unraisablehook = _dropped_by.pop()
    undelivered()  # a timer still waiting never interrupts what runs after the command
    forget_interrupt()


def done() -> None:
    """Back to KeyboardInterrupt (the command has started and handles it), one that lands in a destructor
    included (``_keep``)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.unraisablehook is not _keep:
        _dropped_by.append(sys.unraisablehook)
        sys.unraisablehook = _keep


install()  # on import: cli.py imports this module before anything else
