"""Counters and histograms with label children that cost a few bytecodes to update.

Every request updates about fifteen series (its status, duration, time to
first token, tokens, engine call, admission wait). prometheus_client's
children check their labels and take a lock on every ``inc`` and walk the
buckets in Python on every ``observe``: tens of bytecodes each, the largest
fixed cost of a request's metrics. The daemon updates and renders its
metrics from one Trio thread, so a child here is a plain number (a
counter) or a list of bucket counts found by ``bisect`` (a histogram), and
the family renders them at scrape time as prometheus_client's own metric
families: ``/metrics`` reads exactly as it would with its ``Counter`` and
``Histogram`` (the same names, ``_total`` suffix, ``le`` labels and sample
order; ``*_created`` series are off in this daemon).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Generic, TypeVar

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class Tally:
    """One counter series: a number that only goes up."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class Buckets:
    """One histogram series: the count of observations in each bucket, and their sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds  # the finite upper bounds, sorted; +Inf is the last count
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # the first bucket whose upper bound is at least ``amount`` (``le``: less or equal)
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount

    def observe_spread(self, total: float, n: int) -> None:
        """``n`` equal observations that add up to ``total``, in one step."""
        self.counts[bisect.bisect_left(self._bounds, total / n)] += n
        self.sum += total


_C = TypeVar("_C")  # a child: Tally or Buckets


class _Labelled(Generic[_C]):
    """A family's label children by their values (without labels: one child, made at once)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 new: Callable[[], _C]) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._new: Callable[[], _C] = new
        self._children: dict[tuple[str, ...], _C] = {}
        self._only: _C | None = None if self._labelnames else self.labels()

    def labels(self, *values: object) -> _C:
        """The child of these label values (made on first use)."""
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self._labelnames):
                raise ValueError(f"{self._name} takes the labels {self._labelnames}, "
                                 f"got {len(key)} values")
            child = self._children[key] = self._new()
        return child

    def remove(self, *values: object) -> None:
        """Drop the series of these label values (a ``KeyError`` if there is none)."""
        del self._children[tuple(str(v) for v in values)]

    def _sole(self) -> _C:
        """The one child of a family without labels."""
        if self._only is None:
            raise ValueError(f"{self._name} has labels: update one of its children")
        return self._only


class CounterFamily(_Labelled[Tally], Collector):
    """A counter, with labels or without: ``labels(...).inc()``, or ``inc()``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, Tally)

    def inc(self, amount: float = 1.0) -> None:
        """Count on a family without labels."""
        self._sole().inc(amount)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in self._children.items():
            family.add_metric(values, child.value)
        yield family

    def describe(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self._name, self._doc, labels=self._labelnames)


class HistogramFamily(_Labelled[Buckets], Collector):
    """A histogram, with labels or without: ``labels(...).observe(x)``, or ``observe(x)``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        finite = tuple(b for b in bounds if b != math.inf)
        self._le = (*(floatToGoString(b) for b in finite),  # type: ignore[no-untyped-call]
                    "+Inf")
        super().__init__(name, documentation, labelnames, partial(Buckets, finite))

    def observe(self, amount: float) -> None:
        """Observe on a family without labels."""
        self._sole().observe(amount)

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in self._children.items():
            total = 0
            cumulative: list[tuple[str, float]] = []
            for le, count in zip(self._le, child.counts, strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(values, cumulative, child.sum)
        yield family

    def describe(self) -> Iterable[Metric]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
