"""What every rule shares: the front end, keyword checks, dtypes and schedules (private).

:func:`_build` is the front end of every loss-based rule: a partial when
called without `loss_or_grads` and `params`, the single-function form for
``average=N``, the guard of an accumulation's apply step, and the schedule
counter of a callable learning rate (:func:`_with_schedule`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Concatenate, ParamSpec, TypeVar, cast

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Variable

from .._checks import check_int, check_params
from .._graph import accumulator_dtype, get_or_compute_grads, scalar_state

if TYPE_CHECKING:
    from .._typing import LossOrGrads, LossRule, Params, Updates

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")


def accumulation_of(loss_or_grads: Any) -> Any:
    """The accumulation whose ``.grads`` these are, or None.

    Read from the gradients themselves (each carries ``tag.accumulation``),
    so a copy of the list, ``list(accu.grads)``, is recognised too.
    """
    if not isinstance(loss_or_grads, (list, tuple)) or not loss_or_grads:
        return None
    found = {id(a): a for a in (getattr(getattr(g, "tag", None), "accumulation", None)
                                for g in loss_or_grads)}
    if len(found) == 1:
        return next(iter(found.values()))
    return None


def _is_loss_or_grads(value) -> bool:
    """None, a symbolic variable, or a list or tuple of them (what a rule can take first)."""
    from pytensor.graph.basic import Variable

    if value is None or isinstance(value, Variable):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, Variable) for v in value)


def _build(rule, core, loss_or_grads, params, average, weight, hyper):
    """Shared front end of every loss-based rule.

    Returns a partial of `rule` when both `loss_or_grads` and `params` are
    omitted, routes ``average > 1`` to the accumulating wrapper, and otherwise
    checks the inputs and calls ``core(grads, params, **hyper)``. `hyper`
    holds the rule's hyperparameters and its ``name``.

    When `loss_or_grads` is the ``.grads`` of an :func:`accumulate_gradients`
    result, the rule's updates are guarded (:meth:`Accumulation.guard`): an
    apply function built from them changes nothing on an empty window.
    """
    if loss_or_grads is None and params is None:
        extra = {} if (average == 1 and weight is None) else {"average": average, "weight": weight}
        if hyper.get("name") is None:
            hyper = {k: v for k, v in hyper.items() if k != "name"}
        return partial(rule, **hyper, **extra)
    if params is None and not _is_loss_or_grads(loss_or_grads):
        raise TypeError(
            f"{rule.__name__}(): loss_or_grads must be a scalar loss expression or a list of "
            f"gradient expressions, got {loss_or_grads!r}; to get the rule as a callable "
            f"(for pm.fit(obj_optimizer=...), say), pass its hyperparameters by keyword: "
            f"{rule.__name__}(learning_rate=...)"
        )
    if loss_or_grads is None or params is None:
        missing = "loss_or_grads" if loss_or_grads is None else "params"
        raise ValueError(
            f"{rule.__name__}() got no {missing}: pass both loss_or_grads and params, "
            "or neither to get a partial of the rule with these hyperparameters"
        )
    every = check_int(average, "average")
    if every > 1:
        return _accumulated(rule, loss_or_grads, params, every, weight, hyper)
    if weight is not None:
        raise ValueError(
            f"{rule.__name__}(): weight only applies with average > 1 "
            "(it weights each call's gradient in the accumulated mean)"
        )
    params = check_params(params)
    grads = get_or_compute_grads(loss_or_grads, params)
    # accu.grads of the two-function form: no step on an empty window
    accumulation = accumulation_of(loss_or_grads)
    updates = _with_schedule(rule, core, grads, params, hyper,  # a callable learning_rate
                             accumulation)
    return updates if accumulation is None else accumulation.guard(updates)


_KEYWORD_ALIASES = {"lr": "learning_rate", "eta": "learning_rate", "eps": "epsilon",
                    "beta_1": "beta1", "beta_2": "beta2", "b1": "beta1", "b2": "beta2",
                    "mu": "momentum", "decay": "rho", "every": "average", "n": "average"}


def _rule(fn: _F) -> _F:
    """Mark a public rule: an unknown keyword gets a suggestion (``lr`` -> ``learning_rate``)."""
    known = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for key in kwargs:
            if key not in known:
                guess = _KEYWORD_ALIASES.get(key)
                if guess not in known:
                    close = difflib.get_close_matches(key, known, n=1)
                    guess = close[0] if close else None
                hint = (f"did you mean {guess}=?" if guess
                        else f"its keywords are {', '.join(known)}")
                raise TypeError(
                    f"{fn.__name__}() got an unexpected keyword argument '{key}'; {hint}"
                )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]  # functools.wraps keeps the signature


def _loss_rule(
    fn: Callable[Concatenate[LossOrGrads | None, Params | None, _P],
                 Updates | Callable[..., Updates]],
) -> LossRule[_P]:
    """:func:`_rule` for a loss-based rule, typed by its hyperparameters.

    Type checkers see :class:`~lasagne_accum._typing.LossRule`: the updates
    when called with `loss_or_grads` and `params`, a partial without them.
    """
    return cast("LossRule[_P]", _rule(fn))


def _state_suffix(name, default, what):
    """``W.<suffix>``: ``adam_m`` by default, ``enc_m`` with ``name="enc"``."""
    if name is None:
        return f"{default}_{what}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    return f"{name}_{what}"


def _compute_dtype(param):
    """dtype of a rule's arithmetic and state: the param's, float32 for float16.

    float16 has too little range and precision for optimizer state (Adam's
    epsilon 1e-8 is 0 in float16, its squared gradients underflow), so a
    float16 parameter is updated in float32 and the result cast back.
    """
    return accumulator_dtype(param.type.dtype)


def _require(value, name, rule):
    if value is None:
        raise TypeError(f"{rule}() missing required argument: '{name}'")
    return value


def _timestep_dtype(params):
    """dtype of the bias-correction arithmetic: float32 for float16/32 models, else float64.

    The step counter itself is an int64 (``adam.t``), cast to this dtype where used.
    """
    if not params:
        return "float64"
    return np.result_type(*[accumulator_dtype(p.type.dtype) for p in params]).name


def _cast(x, dtype):
    return x if x.type.dtype == dtype else pt.cast(x, dtype)


def _is_schedule(value):
    return callable(value) and not isinstance(value, Variable)


def _with_schedule(rule, core, grads, params, hyper, accumulation=None):
    """Call ``core``; a callable learning_rate gets a step counter owned by the rule.

    The counter (int64 shared scalar ``<name>.schedule_step``, starting at 0)
    is the schedule's argument, and ``step := step + 1`` joins the rule's
    updates, so it advances exactly when the rule's updates are applied: once
    per apply call in the two-function form, once per stepping call with
    ``average=N`` (the updates sit behind the stepping select). A schedule with
    ``unit="examples"`` advances by the window's total weight instead, and a
    scaling rule with a run-time batch (``linear_scaling(lr, base, None)``) is
    multiplied by ``(total / base) ** power``: both read `accumulation`'s total.
    """
    lr = hyper.get("learning_rate")
    rule_name = getattr(rule, "__name__", "rule")
    if lr is None or not _is_schedule(lr):
        if lr is not None and not isinstance(
                lr, (numbers.Real, np.number, np.ndarray, Variable)):
            raise TypeError(
                f"{rule_name}(): learning_rate must be a number, a symbolic scalar or a "
                "schedule (a callable of the optimizer step, see lasagne_accum.schedules), "
                f"got {type(lr).__name__}"
            )
        return core(grads, params, **hyper)
    examples = getattr(lr, "unit", "steps") == "examples"
    power = getattr(lr, "batch_power", None)
    total = None
    if examples or power is not None:
        what = "unit='examples'" if examples else "a scaling rule with batch_size=None"
        if accumulation is None or accumulation.total is accumulation.count:
            raise ValueError(
                f"{rule_name}(): a learning_rate schedule with {what} reads each window's "
                "number of examples: give the rule accu.grads of "
                "accumulate_gradients(..., weight=<examples in the batch>)")
        total = accumulation.total
    prefix = hyper.get("name") or rule_name
    step = scalar_state(f"{prefix}.schedule_step", "int64")
    value = evaluate_schedule(lr, step, rule_name)
    if power is not None:
        ratio = pt.cast(total, "float64") / float(lr.base_batch_size)
        value = value * (ratio if power == 1 else ratio ** power)
    updates = core(grads, params, **dict(hyper, learning_rate=value))
    advance = pt.cast(pt.round(total), "int64") if examples else pt.constant(np.int64(1))
    updates[step] = step + advance
    return updates


def _accumulated(rule, loss_or_grads, params, every, weight, hyper):
    """The ``average=N`` form: the rule behind :func:`with_accumulated_gradients`.

    A rule's `name` goes to the rule (its state names) and prefixes the
    accumulation's counters (``x.count``; ``average.count`` without a name);
    it must not reach ``with_accumulated_gradients``' own `name` alone.
    """
    from ..single_function import with_accumulated_gradients

    hyper = dict(hyper)
    name = hyper.pop("name", None)
    update_rule = rule if name is None else partial(rule, name=name)
    return with_accumulated_gradients(loss_or_grads, params, every, update_rule,
                                      weight=weight, name=name or "average", **hyper)


def evaluate_schedule(schedule, step, rule_name):
    """``schedule(step)`` on the symbolic step, checked to be a scalar."""
    label = getattr(schedule, "__name__", None) or type(schedule).__name__
    try:
        value = schedule(step)
    except Exception as exc:
        raise TypeError(
            f"{rule_name}(): the learning_rate schedule {label} failed on the symbolic "
            f"int64 step ({type(exc).__name__}: {exc}); a schedule is called once, "
            "with a symbolic step, so build it from lasagne_accum.schedules or "
            "pytensor.tensor operations (pt.switch rather than if)"
        ) from exc
    if isinstance(value, (bool, np.bool_)) or value is None:
        raise TypeError(
            f"{rule_name}(): the learning_rate schedule {label} returned {value!r}; it must "
            "return a scalar (a number or a symbolic scalar)"
        )
    if isinstance(value, (numbers.Real, np.number)):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, Variable):
        ndim = value.ndim if isinstance(value, np.ndarray) else getattr(value.type, "ndim", None)
        if ndim != 0:
            raise ValueError(
                f"{rule_name}(): the learning_rate schedule {label} returned a value with "
                f"{ndim} dimensions ({getattr(value, 'type', value.shape)}); it must return a "
                "scalar for a scalar step"
            )
        return value if isinstance(value, Variable) else value[()]
    raise TypeError(
        f"{rule_name}(): the learning_rate schedule {label} returned "
        f"{type(value).__name__}; it must return a scalar (a number or a symbolic scalar)"
    )


