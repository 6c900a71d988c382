"""Ultralytics training with the optimized criterion: one line, off unless asked.

    from fxpasses.integrations import ultralytics as fxu

    model = YOLO("yolo26n-pose.yaml")
    fxu.enable(model)                        # passes=None: PairRLE, SelectRows, CaptureLoss
    model.train(data="pose.yaml", epochs=5)  # the trainer's log gains one fxpasses line

How it holds for what the trainer does (ultralytics 8.4):

* The trainer trains a model of its own (``get_model`` builds it from the YOLO object's config or
  weights; resume rebuilds it from the checkpoint), so wrapping ``yolo.model.criterion`` would not
  reach it. :func:`enable` registers trainer callbacks instead: at ``on_pretrain_routine_end``
  (after DDP wrapping, the EMA copy and resume) the trained model's criterion (de-paralleled; built
  by its ``init_criterion()`` when still lazy, or the one resume built and advanced) becomes an
  :class:`OptimizedCriterion`. Given a ``BaseModel`` instead (a loop of one's own), its criterion
  is built and wrapped at once.
* :class:`OptimizedCriterion` calls the :class:`~fxpasses.OptimizedLoss`; every other attribute is
  the native criterion's, read and written through (the trainer's per-epoch ``update()`` and
  resume's ``updates`` reach it; the loss reads ``o2m`` on every call). Pickled or deep-copied, it
  is the native criterion: a checkpoint, or a model a user saves, loads without fxpasses.
* Forward and backward run under the trainer's autocast and GradScaler as natively (the loss's
  autocast state is guarded per trace). Validation runs on the EMA model, copied before the
  wrapping, with its own native criterion; a wrapped criterion called with grad disabled runs
  natively without a warning.
* DDP: Ultralytics' launcher sends the trainer's callbacks to its ranks (cloudpickle), ``torchrun``
  runs the script on each rank: either way each rank wraps its own model's criterion; gradients
  are reduced by DDP as natively.
* A criterion that cannot be wrapped (no ``init_criterion``, optimize() refuses it) stays native
  with one line in the trainer's log naming why (code ``integration-unsupported``).
* At ``on_train_end``: one line in the trainer's log (calls optimized/native, recordings), and
  ``explain()`` and the certificates in ``fxpasses.txt`` / ``fxpasses.json`` beside ``results.csv``.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ..certificates.codes import note
from ..optimize import OptimizedLoss, optimize
from ..pipeline import Pass

REPORT = "fxpasses"  # trainer.save_dir / "fxpasses.json" and "fxpasses.txt"


def default_passes() -> list[Pass]:
    """Fresh ``[PairRLE(), SelectRows(), CaptureLoss()]``, the intended pipeline."""
    from ..passes import CaptureLoss, PairRLE, SelectRows

    return [PairRLE(), SelectRows(), CaptureLoss()]


class OptimizedCriterion:
    """A criterion called through ``optimized``; every other attribute is ``native``'s.

    Reading, writing and ``hasattr`` go to the native criterion (``update()``, ``updates``,
    ``o2m``...). Pickling or copying gives the native criterion itself (a deep copy of it for
    ``deepcopy``), so nothing of fxpasses enters a pickle.
    """

    def __init__(self, native: Any, optimized: OptimizedLoss):
        object.__setattr__(self, "native", native)
        object.__setattr__(self, "optimized", optimized)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimized(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only names this object does not hold
        if name in ("native", "optimized"):
            raise AttributeError(name)
        return getattr(self.native, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.native, name, value)

    def __reduce__(self) -> tuple:
        return operator.itemgetter(0), ((self.native,),)  # rebuilt as the native criterion

    def __repr__(self) -> str:
        return f"OptimizedCriterion({self.native!r})"


def _log() -> Any:
    from ultralytics.utils import LOGGER

    return LOGGER


def _unwrap(model: Any) -> Any:
    from ultralytics.utils.torch_utils import unwrap_model

    return unwrap_model(model)


class Integration:
    """The trainer callbacks :func:`enable` registers (picklable: DDP ranks receive them).

    ``criteria`` holds each criterion this process wrapped, last one last.
    """

    def __init__(self, passes: Sequence[Pass] | None = None, store: str | os.PathLike | None = None,
                 background: bool = False):
        self.passes = None if passes is None else list(passes)
        self.store = store
        self.background = background
        self.criteria: list[OptimizedCriterion] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"passes": self.passes, "store": self.store, "background": self.background,
                "criteria": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["passes"], state["store"], state.get("background", False))

    @property
    def criterion(self) -> OptimizedCriterion | None:
        """The criterion wrapped last (None before a fit, or when it could not be wrapped)."""
        return self.criteria[-1] if self.criteria else None

    def wrap(self, model: Any) -> OptimizedCriterion | None:
        """Wrap ``model.criterion`` (built by ``model.init_criterion()`` when None); one log line
        naming why when it cannot be, and the model keeps its native criterion."""
        current = getattr(model, "criterion", None)
        if isinstance(current, OptimizedCriterion):
            return current
        try:
            native = current if current is not None else model.init_criterion()
            optimized = optimize(native, default_passes() if self.passes is None else self.passes,
                                 store=self.store, background=self.background)
        except (AttributeError, NotImplementedError, TypeError, ValueError) as exc:
            note("integration-unsupported")
            _log().warning(f"fxpasses: integration-unsupported: the criterion of "
                           f"{type(model).__name__} runs natively ({type(exc).__name__}: {exc})")
            return None
        wrapped = OptimizedCriterion(native, optimized)
        model.criterion = wrapped
        self.criteria.append(wrapped)
        return wrapped

    def on_pretrain_routine_end(self, trainer: Any) -> None:
        """Wrap the criterion of the model this trainer trains (DDP or compiled: its module)."""
        self.wrap(_unwrap(trainer.model))

    def on_train_end(self, trainer: Any) -> None:
        """One line in the trainer's log; ``explain()`` and certificates beside results.csv."""
        criterion = getattr(_unwrap(trainer.model), "criterion", None)
        if not isinstance(criterion, OptimizedCriterion):
            return
        save_dir = Path(trainer.save_dir)
        fast = criterion.optimized
        try:  # the fit is done and saved: a report that cannot be written does not fail it
            fast.save_certificates(save_dir / f"{REPORT}.json")
            (save_dir / f"{REPORT}.txt").write_text(fast.explain() + "\n")
        except Exception as exc:  # noqa: BLE001 - named in the log line
            _log().warning(f"fxpasses: {summary(criterion)}; report not written "
                           f"({type(exc).__name__}: {exc})")
            return
        _log().info(f"fxpasses: {summary(criterion)}; explain() in {save_dir / REPORT}.txt")


def summary(criterion: OptimizedCriterion) -> str:
    """What was optimized, calls optimized/native (by code), recordings, regions that could not
    be recorded: one line."""
    fast = criterion.optimized
    stats = fast.stats
    applied = sorted({c.pass_name for c in fast.certificates
                      if c.decision == "applied" and c.pass_name != "trace"})
    native = ", ".join(f"{code} {n}" for code, n in stats.native.most_common())
    recorded = sum(counters.get("recorded", 0) for counters in stats.sites.values())
    failed = sum(1 for counters in stats.sites.values() if counters.get("capture-failed"))
    stored = [("read" if c.applied else c.codes[0]) for c in fast.certificates if c.pass_name == "store"]
    return (f"{type(criterion.native).__name__} with {', '.join(p.name for p in fast.passes)} "
            f"(applied: {', '.join(applied) or 'none'}): {stats.calls} calls, {stats.optimized} "
            f"optimized, {sum(stats.native.values())} native{f' ({native})' if native else ''}, "
            f"{len(fast.specializations)} traces, {recorded} recordings"
            + (f", store: {', '.join(stored)}" if stored else "")
            + (f", {failed} regions not recorded (capture-failed: they ran eagerly; "
               f"FXPASSES_LOG=WARNING names why)" if failed else ""))


def enable(model: Any, passes: Sequence[Pass] | None = None,
           store: str | os.PathLike | None = None, background: bool = False) -> Integration:
    """Train ``model`` with its criterion optimized by ``passes`` (None: :func:`default_passes`);
    ``store``: a directory that keeps the passes' results across fits (:mod:`fxpasses.store`);
    ``background`` (with a ``store``): a fit that finds no stored result trains natively while
    the passes run in another process, and optimized from the first step after
    (:mod:`fxpasses.background`).

    ``model``: a ``YOLO`` object (call before ``model.train(...)``: registers the callbacks of
    :class:`Integration` for every later fit, replacing those of an earlier ``enable``), or an
    Ultralytics ``BaseModel`` (its criterion is wrapped now, unless it already is). Returns the
    :class:`Integration`, whose ``criterion`` tells what happened.
    """
    if background and store is None:
        raise ValueError("enable(..., background=True) needs a store: the other process hands "
                         "its result back through it (store='~/.cache/fxpasses')")
    integration = Integration(passes, store, background)
    if callable(getattr(model, "add_callback", None)) and hasattr(model, "callbacks"):
        events: dict[str, Callable[[Any], None]] = {
            "on_pretrain_routine_end": integration.on_pretrain_routine_end,
            "on_train_end": integration.on_train_end}
        for event, callback in events.items():
            model.callbacks[event] = [c for c in model.callbacks.get(event, [])
                                      if not isinstance(getattr(c, "__self__", None), Integration)]
            model.add_callback(event, callback)
    elif hasattr(model, "init_criterion"):
        integration.wrap(model)
    else:
        raise TypeError(f"enable() needs a YOLO object or an Ultralytics BaseModel, "
                        f"got {type(model).__name__}")
    return integration
